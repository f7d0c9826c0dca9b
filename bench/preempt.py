"""A light tenant beside a heavy one through the real gateway (gunicorn with its default workers, or
two gateways), on simulated engines: what a light key's time to first token is alone and beside a
heavy key that keeps many streams outstanding, and what the heavy key keeps of its throughput, with
fair order and eviction on, with fair order only, and first come first served, in one run.

    python -m bench.preempt [--slots 4] [--heavy 32] [--light-requests 40] [--gateways 1] [--seconds 20]

`fcfs` makes each light request wait out the heavy backlog (about 13 s with the defaults, so 40 of them
take minutes); `--modes fair,evict` leaves it out.

Each mode starts a fresh gateway (or two) on the same engine: `fcfs` (LLMGW_GATEWAY_FAIRNESS=fcfs,
LLMGW_GATEWAY_EVICT=0), `fair` (the key least served first, no eviction) and `evict` (the defaults:
fair order and eviction). The light key sends one short streamed request at a time; the heavy key keeps
`--heavy` long streams outstanding (a closed loop). Every heavy answer is checked against the engine's
own undisturbed answer to the same request: an evicted answer must resume word for word.

Prints, per mode: the light key's TTFT p50 and p99 alone and beside the heavy key (and their ratio),
the heavy key's completed answers per second and tokens per second (and their ratio to fcfs's), the
evictions the gateways counted, the pause p50/p99 (histogram buckets' upper bounds), how many answers
were cut or differed from the undisturbed one (`bad`: must be 0), and how many heavy requests were
refused (429) before they began.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests

from bench.report import pct

MODES = {
    "fcfs": {"LLMGW_GATEWAY_FAIRNESS": "fcfs", "LLMGW_GATEWAY_EVICT": "0"},
    "fair": {"LLMGW_GATEWAY_EVICT": "0"},
    "evict": {},
}


def light_ttft(url: str, key: str, n: int, stop: threading.Event | None = None) -> list[float]:
    """TTFTs of `n` short streamed requests, one at a time."""
    out = []
    s = requests.Session()
    for i in range(n):
        if stop is not None and stop.is_set():
            break
        body = {"model": "m", "messages": [{"role": "user", "content": f"light {i}"}], "max_tokens": 8, "stream": True}
        t0 = time.monotonic()
        with s.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                    stream=True, timeout=120) as r:
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith(b"data: {") and b'"content"' in line:
                    first = time.monotonic() - t0
            out.append(first if first is not None else float("inf"))
    return out


class Heavy:
    """`n` clients of the heavy key, each sending long streams back to back, checked word for word."""

    def __init__(self, urls: list[str], key: str, n: int, tokens: int, engine: str):
        self.urls, self.key, self.n, self.tokens, self.engine = urls, key, n, tokens, engine
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done: list[tuple[float, int]] = []  # (end time, tokens)
        self.bad: list[str] = []  # answers cut or different from the undisturbed one
        self.refused = 0  # requests refused (429) before they began
        self.want: dict[int, str] = {}
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(n)]

    def expected(self, i: int) -> str:
        if i not in self.want:
            body = {"model": "m", "messages": [{"role": "user", "content": f"heavy {i}"}], "max_tokens": self.tokens}
            self.want[i] = requests.post(self.engine + "/v1/chat/completions", json=body,
                                         timeout=120).json()["choices"][0]["message"]["content"]
        return self.want[i]

    def start(self) -> None:
        for i in range(self.n):
            self.expected(i)
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        s = requests.Session()
        url = self.urls[i % len(self.urls)]
        body = {"model": "m", "messages": [{"role": "user", "content": f"heavy {i}"}], "max_tokens": self.tokens,
                "stream": True}
        while not self.stop.is_set():
            try:
                text, ok = [], False
                with s.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {self.key}"},
                            stream=True, timeout=300) as r:
                    if r.status_code != 200:  # refused (a shed queue): not an answer lost
                        with self.lock:
                            self.refused += 1
                        time.sleep(float(r.headers.get("Retry-After") or 1))  # noqa: as a client backs off
                        continue
                    for line in r.iter_lines():
                        if line == b"data: [DONE]":
                            ok = True
                        elif line.startswith(b"data: {"):
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                raise RuntimeError(ev["error"].get("message"))
                            for c in ev.get("choices", ()):
                                text.append((c.get("delta") or {}).get("content") or "")
                got = "".join(text)
                with self.lock:
                    if not ok or got != self.want[i]:
                        self.bad.append(f"heavy {i}: {'cut' if not ok else 'differs'}")
                    else:
                        self.done.append((time.monotonic(), self.tokens))
            except Exception as e:  # noqa: BLE001 - counted, and the client goes on
                with self.lock:
                    self.bad.append(f"heavy {i}: {type(e).__name__}: {e}")

    def rate(self, since: float, until: float) -> tuple[float, float]:
        with self.lock:
            got = [d for d in self.done if since <= d[0] <= until]
        span = max(1e-9, until - since)
        return len(got) / span, sum(t for _, t in got) / span

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def gateway_metric(url: str, sample: str) -> float:
    total = 0.0
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(sample):
            total += float(line.split()[-1])
    return total


def pause_quantiles(urls: list[str]) -> tuple[float | None, float | None]:
    """The pause histogram's p50 and p99 (bucket upper bounds), every gateway's together."""
    buckets: dict[float, float] = {}
    for url in urls:
        for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("llmgw_gateway_pause_seconds_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                buckets[float(le)] = buckets.get(float(le), 0.0) + float(line.split()[-1])
    if not buckets or not buckets.get(float("inf")):
        return None, None
    total = buckets[float("inf")]
    def q(p):
        return next(le for le, n in sorted(buckets.items()) if n >= p * total)
    return q(0.5), q(0.99)


def run_mode(cluster, engine: str, mode: str, a, keys) -> dict:
    from harness.procs import wait_until

    urls = [cluster.start_gateway(name=f"gw-{mode}-{g}", **{"LLMGW_GATEWAY_WORKERS": str(a.workers),
                                                             **MODES[mode]}) for g in range(a.gateways)]
    for u in urls:
        wait_until(lambda u=u: requests.get(u + "/readyz", timeout=2).status_code == 200, 30, what=f"{u} ready")
    heavy_key, light_key = keys
    alone = light_ttft(urls[0], light_key, a.light_requests)
    heavy = Heavy(urls, heavy_key, a.heavy, a.heavy_tokens, engine)
    heavy.start()
    time.sleep(a.warmup)  # noqa: the heavy backlog builds (a benchmark's warm-up, not a synchronisation)
    t0 = time.monotonic()
    beside = light_ttft(urls[-1], light_key, a.light_requests)
    elapsed = max(a.seconds, time.monotonic() - t0)
    while time.monotonic() - t0 < a.seconds:
        time.sleep(0.2)  # noqa: the heavy key runs on for the window
    t1 = time.monotonic()
    per_s, tok_s = heavy.rate(t0, t1)
    heavy.finish()
    evictions = sum(gateway_metric(u, "llmgw_gateway_evictions_total") for u in urls)
    p50, p99 = pause_quantiles(urls)
    for g in range(a.gateways):
        cluster.procs.get(f"gw-{mode}-{g}").stop()
    return {"mode": mode, "alone": alone, "beside": beside, "heavy_per_s": per_s, "heavy_tok_s": tok_s,
            "evictions": evictions, "pause": (p50, p99), "bad": heavy.bad, "refused": heavy.refused,
            "elapsed": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=4, help="sequences the engine runs at once (its capacity)")
    ap.add_argument("--heavy", type=int, default=32, help="streams the heavy key keeps outstanding")
    ap.add_argument("--heavy-tokens", type=int, default=64)
    ap.add_argument("--light-requests", type=int, default=40)
    ap.add_argument("--gateways", type=int, default=1)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="each gateway's (default: its own)")
    ap.add_argument("--seconds", type=float, default=20.0, help="the heavy throughput window")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the engine's decode step")
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args()

    from harness.cluster import Cluster
    from harness.procs import free_port, python, wait_until
    from llmgw.state.records import EndpointInfo
    from llmgw import surface

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-preempt-"))
    cluster = Cluster(workdir)
    try:
        cluster.start_redis()
        port = free_port()
        cluster.procs.start("engine", [python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m",
                                       "--max-seqs", str(a.slots), "--step-ms", str(a.step_ms)])
        engine = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(engine + "/health", timeout=1).ok, 20, what="the engine")
        store = cluster.store()
        store.write_endpoints([EndpointInfo(id="e0", url=engine, models=("m",), engine="sim", model="m",
                                            served_name="m", capacity=a.slots,
                                            paths=surface.same_paths(surface.CHAT, surface.COMPLETIONS))],
                              "bench", time.time())
        keys = (store.create_key("heavy")[1], store.create_key("light")[1])
        print(f"engine: {a.slots} slots, {a.step_ms:g} ms steps; heavy key: {a.heavy} streams of "
              f"{a.heavy_tokens} tokens outstanding; light key: {a.light_requests} streams of 8 tokens, one at a "
              f"time; {a.gateways} gateway(s) of {a.workers} worker(s)")
        rows = [run_mode(cluster, engine, m, a, keys) for m in a.modes.split(",")]
        base = next((r for r in rows if r["mode"] == "fcfs"), rows[0])
        print(f"{'mode':6} {'alone p50':>9} {'p99':>7} {'beside p50':>10} {'p99':>7} {'p99/alone':>9} "
              f"{'heavy/s':>8} {'tok/s':>7} {'/fcfs':>6} {'evicted':>7} {'pause p50':>9} {'p99':>6} {'bad':>4} "
              f"{'429':>4}")
        for r in rows:
            a50, a99 = statistics.median(r["alone"]), pct(r["alone"], 0.99)
            b50, b99 = statistics.median(r["beside"]), pct(r["beside"], 0.99)
            rel = r["heavy_tok_s"] / base["heavy_tok_s"] if base["heavy_tok_s"] else float("nan")
            p50, p99 = r["pause"]
            print(f"{r['mode']:6} {a50:9.3f} {a99:7.3f} {b50:10.3f} {b99:7.3f} {b99 / a99:9.2f} "
                  f"{r['heavy_per_s']:8.2f} {r['heavy_tok_s']:7.0f} {rel:6.2f} {r['evictions']:7.0f} "
                  f"{p50 if p50 is not None else float('nan'):9.3f} {p99 if p99 is not None else float('nan'):6.3f} "
                  f"{len(r['bad']):4d} {r['refused']:4d}")
        for r in rows:
            slow = sorted(r["beside"])[-5:]
            print(f"  {r['mode']}: the light key's slowest TTFTs beside the heavy key: "
                  + ", ".join(f"{x:.3f}" for x in slow))
            for b in r["bad"][:5]:
                print(f"  {r['mode']}: {b}")
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
