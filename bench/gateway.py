"""What the gateway adds to a request: latency over a direct call (p50, p99) at concurrency 1 and 32,
JSON and streaming, and requests per second of tiny requests.

    python bench/gateway.py [--seconds 6] [--workers 1]

`gw cpu/req` is the gateway's CPU time (user + system of gunicorn's master and workers, from /proc)
over its run of a case, per request.

Starts its own redis-server, an instant fake engine and the gateway (its one gunicorn config: the
gevent worker), prints the figures and stops everything. Clients use raw keep-alive http.client connections so the client's own
cost stays small and is the same for the direct and the proxied calls.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from bench.streams import cpu_seconds, tree  # noqa: E402
from llmgw.state.records import EndpointInfo  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.fake_upstream import start_process  # noqa: E402
from tests.support.procs import wait_until  # noqa: E402

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
SBODY = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def run(url: str, body: bytes, concurrency: int, seconds: float) -> tuple[list[float], float]:
    """Closed loop: `concurrency` clients send back to back for `seconds`; (latencies, req/s)."""
    host, port = url.split("//")[1].split(":")
    lat: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client():
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        mine = []
        while time.monotonic() < stop:
            t = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                raise SystemExit(f"{url}: HTTP {r.status}")
            mine.append(time.perf_counter() - t)
        conn.close()
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, len(lat) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="llmgw-bench-gw-")))
    try:
        cluster.start_redis()
        engine = start_process(cluster.procs, "engine", base=0, tokens=4, max_seqs=256)
        cluster.store().write_endpoints(
            [EndpointInfo(id="e1", url=engine, models=("m",), engine="sim", model="m", served_name="m")],
            "bench", time.time())
        gw = cluster.start_gateway(LLMGW_GATEWAY_WORKERS=str(a.workers))
        import requests

        wait_until(lambda: requests.get(gw + "/healthz", timeout=1).json()["endpoints"] == 1, 20, what="gateway")
        run(gw, BODY, 4, 1.0)  # warm the pools
        print(f"gateway overhead ({os.cpu_count()} cores shared by client, gateway and engine; "
              f"{a.workers} gunicorn gevent worker(s))")
        pids = tree(cluster.procs.get("gateway").pid)  # gunicorn's master and workers
        print(f"{'case':28} {'direct p50':>11} {'gw p50':>9} {'added p50':>10} {'direct p99':>11} "
              f"{'gw p99':>9} {'added p99':>10} {'direct rps':>11} {'gw rps':>8} {'gw cpu/req':>10}")
        for name, body, conc in (("json, concurrency 1", BODY, 1), ("stream, concurrency 1", SBODY, 1),
                                 ("json, concurrency 32", BODY, 32), ("stream, concurrency 32", SBODY, 32)):
            d, drps = run(engine, body, conc, a.seconds / 2)
            cpu0 = cpu_seconds(pids)
            g, grps = run(gw, body, conc, a.seconds / 2)
            cpu = (cpu_seconds(pids) - cpu0) / max(1, len(g))  # the gateway's CPU only: clients are threads here
            ms = lambda x: f"{x * 1000:.2f}ms"  # noqa: E731
            print(f"{name:28} {ms(pct(d, .5)):>11} {ms(pct(g, .5)):>9} {ms(pct(g, .5) - pct(d, .5)):>10} "
                  f"{ms(pct(d, .99)):>11} {ms(pct(g, .99)):>9} {ms(pct(g, .99) - pct(d, .99)):>10} "
                  f"{drps:>11.0f} {grps:>8.0f} {ms(cpu):>10}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
