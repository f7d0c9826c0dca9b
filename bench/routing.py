"""Routing on a heterogeneous fleet: p50/p99 latency and time to first token of streamed requests at
80 % of the fleet's capacity, for llmgw's router against round robin and least in-flight.

    python bench/routing.py [--seconds 15] [--load 0.8]

Four simulated engines (`python -m simengine`, speeds 1, 1, 0.5 and 0.25, 4 sequences each)
behind one gateway per policy (LLMGW_GATEWAY_POLICY). Arrivals are open-loop (evenly paced, so a slow
answer does not slow the arrivals, as with real users). Each policy gets a short warm-up that is not
measured. Starts redis, engines and gateways itself and stops them all.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from llmgw.state.records import EndpointInfo  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.loadgen import paced  # noqa: E402
from tests.support.procs import free_port, python, wait_until  # noqa: E402

SPEEDS = {"fast-1": 1.0, "fast-2": 1.0, "half": 0.5, "quarter": 0.25}
MAX_SEQS = 4
MAX_TOKENS = 16
BODY = json.dumps({"model": "m", "stream": True, "max_tokens": MAX_TOKENS,
                   "messages": [{"role": "user", "content": "tell me something"}]}).encode()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def start_engine(cluster: Cluster, name: str, speed: float) -> str:
    port = free_port()
    cluster.procs.start(f"engine-{name}", [
        python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m",
        "--max-seqs", str(MAX_SEQS), "--speed", str(speed), "--seed", "1"], env=cluster.env())
    url = f"http://127.0.0.1:{port}"
    import requests

    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 30, what=f"engine {name}")
    return url


def measure_service_time(url: str) -> float:
    """One request alone on an idle engine: its service time at batch one."""
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    t = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
    conn.getresponse().read()
    return time.perf_counter() - t


def open_loop(url: str, rate: float, seconds: float) -> tuple[list[float], list[float], int]:
    host, port = url.split("//")[1].split(":")
    lat, ttft, errors = [], [], [0]
    lock = threading.Lock()
    local = threading.local()

    def one():
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        t = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
            r = conn.getresponse()
            first = None
            while True:
                chunk = r.read1(65536)
                if not chunk:
                    break
                if first is None and b'"content": "' in chunk.replace(b'"content": ""', b""):
                    first = time.perf_counter() - t
            ok = r.status == 200
        except (OSError, http.client.HTTPException):
            local.conn = None
            ok = False
        with lock:
            if ok:
                lat.append(time.perf_counter() - t)
                ttft.append(first if first is not None else lat[-1])
            else:
                errors[0] += 1

    paced(one, rate, seconds, max_workers=120)
    return lat, ttft, errors[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--load", type=float, default=0.8, help="offered load as a fraction of capacity")
    ap.add_argument("--policies", default="llmgw,least_inflight,round_robin")
    a = ap.parse_args()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-")))
    try:
        cluster.start_redis()
        urls = {n: start_engine(cluster, n, s) for n, s in SPEEDS.items()}
        # Capacity: each engine finishes MAX_SEQS requests per (batched) service time.
        base = measure_service_time(urls["fast-1"])
        batched = base * (1 + 0.08 * (MAX_SEQS - 1))  # the sim's default batch slowdown
        capacity = sum(MAX_SEQS * s / batched for s in SPEEDS.values())
        rate = a.load * capacity
        cluster.store().write_endpoints(
            [EndpointInfo(id=n, url=u, models=("m",), engine="sim", model="m", served_name="m", capacity=MAX_SEQS)
             for n, u in urls.items()], "bench", time.time())
        print(f"fleet: speeds {list(SPEEDS.values())}, {MAX_SEQS} seqs each, service {base * 1000:.0f} ms alone; "
              f"capacity ~{capacity:.1f} req/s; offering {rate:.1f} req/s ({a.load:.0%}) for {a.seconds:.0f}s")
        print(f"{'policy':16} {'p50':>8} {'p99':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'requests':>9} {'errors':>7}")
        for policy in a.policies.split(","):
            gw = cluster.start_gateway(port=free_port(), LLMGW_GATEWAY_POLICY=policy, LLMGW_GATEWAY_SEED="1",
                                       LLMGW_GATEWAY_QUEUE_TIMEOUT="30")
            import requests

            wait_until(lambda: requests.get(gw + "/healthz").json()["endpoints"] == len(urls), 10, what="endpoints")
            open_loop(gw, rate / 2, 2.0)  # warm-up: the router learns the speeds
            lat, ttft, errors = open_loop(gw, rate, a.seconds)
            print(f"{policy:16} {pct(lat, .5):>7.2f}s {pct(lat, .99):>7.2f}s {pct(ttft, .5):>8.2f}s "
                  f"{pct(ttft, .99):>8.2f}s {len(lat):>9} {errors:>7}", flush=True)
            cluster.procs.get("gateway").stop()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
