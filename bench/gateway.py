"""What a proxy adds to a request, llmgw's gateway beside nginx and vLLM's router in one run: latency
over a direct call (p50, p99), requests per second, and the proxy's CPU time per request, at
concurrency 1 and 32, JSON and streamed (SSE).

    python -m bench.gateway [--seconds 5] [--targets direct,nginx,vllm-router,llmgw] [--features]
                            [--profile] [--workers N]

- Engines: two bench/fast_engine.py processes (an answer costs them next to nothing; a stream is 8
  SSE events sent at once). Load: wrk (Debian package `wrk`), one thread, keep-alive connections,
  the same for every target (bench/wrk.py).
- nginx (round robin, one worker per core), vLLM's router (`vllm-router`, round robin; pip extra
  `bench`) and llmgw's gateway (its gunicorn config, one gevent worker per core) each front both
  engines. A peer that is not installed is left out, with the reason.
- `cpu/req`: user + system CPU of the proxy's processes over its run, per request; `x router`: that
  figure over vLLM's router's in the same case.
- `floor-answer` and `floor-proxy` (bench/floor.py): the same server model as llmgw's gateway answering
  by itself, and passing requests through its engine client with nothing else: the floor under
  llmgw's CPU per request.
- `--features`: llmgw again with one part of its request path off or on, to show what each costs:
  no prefix keys (LLMGW_GATEWAY_PREFILL_MS_PER_TOKEN=0), no sharing between gateways
  (LLMGW_GATEWAY_SHARE_SENDS=0), round robin instead of the load-aware choice
  (LLMGW_GATEWAY_POLICY=round_robin), answer renaming (the client asks for an alias, so every
  `"model"` of the answer is rewritten), tracing on (OTLP export to a local sink).
- `--profile`: where llmgw's gateway spends its CPU at concurrency 32 (JSON, then SSE): py-spy's
  samples of one worker, by function, inclusive and self.

Starts everything itself (its own redis-server) and stops it all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench import peers, wrk

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
SBODY = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
CASES = (("json c1", BODY, 1), ("sse c1", SBODY, 1), ("json c32", BODY, 32), ("sse c32", SBODY, 32))
# llmgw with one part of the request path changed: (name, environment, model asked for)
FEATURES = (
    ("llmgw no-prefix-keys", {"LLMGW_GATEWAY_PREFILL_MS_PER_TOKEN": "0"}, "m"),
    ("llmgw no-sharing", {"LLMGW_GATEWAY_SHARE_SENDS": "0"}, "m"),
    ("llmgw round-robin", {"LLMGW_GATEWAY_POLICY": "round_robin"}, "m"),
    ("llmgw renaming", {}, "r"),
    ("llmgw tracing", {"OTEL_TRACES_SAMPLER": "always_on"}, "m"),
)


def pct_ms(x: float) -> str:
    return f"{x * 1000:.2f}"


def profile(pid: int, seconds: float, url: str, body: bytes, conns: int, top: int = 14) -> str:
    """py-spy's samples of `pid` while wrk loads `url`: the functions with the most samples."""
    binary = Path(sys.executable).parent / "py-spy"
    if not binary.exists():
        return f"  (no py-spy at {binary}: pip install -e '.[bench]' installs it)"
    out = tempfile.mktemp(suffix=".txt")
    spy = subprocess.Popen([str(binary), "record", "-p", str(pid), "-d",
                            str(max(1, round(seconds))), "-r", "200", "-f", "raw", "-o", out, "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wrk.run(url, body, conns, seconds)
    spy.wait(timeout=seconds + 60)
    incl: Counter[str] = Counter()
    self_: Counter[str] = Counter()
    total = 0
    try:
        lines = Path(out).read_text().splitlines()
    except OSError:
        return "  (py-spy wrote nothing: is it installed, and may it trace this process?)"
    finally:
        Path(out).unlink(missing_ok=True)
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].split("/")[-1] + ")" if " (" in f else f
                  for f in stack.split(";")]
        for f in set(frames):
            incl[f] += count
        self_[frames[-1]] += count
    if not total:
        return "  (no samples)"
    rows = [f"  {'inclusive':>9} {'self':>6}  function (file)"]
    for f, n in incl.most_common(top * 3):
        if f.startswith(("<module>", "run (", "_run (", "handle (", "serve_forever", "start (", "run_forever")):
            continue
        rows.append(f"  {100 * n / total:8.1f}% {100 * self_[f] / total:5.1f}%  {f}")
        if len(rows) > top:
            break
    rows.append(f"  self time, top {top}:")
    rows += [f"  {'':9} {100 * n / total:5.1f}%  {f}" for f, n in self_.most_common(top)]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per case and target")
    ap.add_argument("--targets", default="direct,nginx,vllm-router,llmgw,floor-proxy",
                    help="of direct, nginx, vllm-router, llmgw, floor-answer, floor-proxy (bench/floor.py)")
    ap.add_argument("--workers", type=int, default=0, help="gateway workers (default: one per core, as deployed)")
    ap.add_argument("--features", action="store_true", help="also llmgw with one part of its path off or on")
    ap.add_argument("--profile", action="store_true", help="py-spy profile of one gateway worker at c32")
    a = ap.parse_args()
    if not wrk.available():
        sys.exit("bench/gateway.py needs wrk (apt-get install wrk)")

    from harness.cluster import Cluster
    from harness.procs import free_port, wait_until
    import requests

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-gw-"))
    cluster = Cluster(workdir)
    targets: list[peers.Target] = []
    bodies: dict[str, tuple[bytes, bytes]] = {}
    try:
        cluster.start_redis()
        engines = peers.start_engines(cluster.procs, 2, 0.0, 8, wait_until, free_port)
        store = cluster.store()
        from llmgw.state.records import EndpointInfo

        # Model `m` on both engines; `r` too, served there as `m` (so its answers are renamed).
        store.write_endpoints(
            [EndpointInfo(id=f"e{i}", url=u, models=("m",), engine="sim", model="m", served_name="m")
             for i, u in enumerate(engines)]
            + [EndpointInfo(id=f"r{i}", url=u, models=("r",), engine="sim", model="r", served_name="m")
               for i, u in enumerate(engines)], "bench", time.time())
        wanted = a.targets.split(",")
        workers = str(a.workers or os.cpu_count() or 1)
        if "direct" in wanted:
            targets.append(peers.Target("direct", engines[:1], None))
        if "nginx" in wanted:
            port = free_port()
            ng = peers.start_nginx(cluster.procs, workdir, engines, port, least_conn=False)
            if ng is None:
                print("nginx not found (apt-get install nginx): left out")
            else:
                url = f"http://127.0.0.1:{port}"
                wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 15, what="nginx")
                targets.append(peers.Target("nginx", [url], lambda ng=ng: peers.tree(ng.pid)))
        if "vllm-router" in wanted:
            port = free_port()
            vr = peers.start_vllm_router(cluster.procs, engines, port, free_port)
            if vr is None:
                print("vllm-router not found (pip install -e '.[bench]'): left out")
            else:
                url = f"http://127.0.0.1:{port}"
                wait_until(lambda: requests.get(url + "/v1/models", timeout=1).ok, 60, what="vllm-router")
                targets.append(peers.Target("vllm-router", [url], lambda vr=vr: peers.tree(vr.pid)))
        for floor in [w for w in wanted if w in ("floor-answer", "floor-proxy")]:  # bench/floor.py
            port = free_port()
            fp = cluster.procs.start(floor, [str(Path(sys.executable).parent / "gunicorn"), "-c",
                                             "python:gateway.gunicorn_conf", "-b", f"127.0.0.1:{port}", "-w", workers,
                                             f"bench.floor:{floor.split('-')[1]}"],
                                     env={"FLOOR_ENGINES": ",".join(engines), "PYTHONPATH": str(ROOT)}, cwd=ROOT)
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda url=url: requests.post(url + "/v1/chat/completions", data=BODY, timeout=2).ok, 30,
                       what=floor)
            targets.append(peers.Target(floor, [url], lambda fp=fp: peers.tree(fp.pid)))
        variants = [("llmgw", {}, "m")] if "llmgw" in wanted else []
        if a.features:
            variants += list(FEATURES)
        sink = None
        for name, env, model in variants:
            env = dict(env)
            if name.endswith("tracing"):
                if sink is None:
                    sink = peers.start_engines(cluster.procs, 1, 0.0, 1, wait_until, free_port)[0]
                env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink
            gw = cluster.start_gateway(name=name.replace(" ", "-"), LLMGW_GATEWAY_WORKERS=workers, **env)
            wait_until(lambda gw=gw: requests.get(gw + "/readyz", timeout=1).ok, 30, what=f"{name} ready")
            proc = cluster.procs.get(name.replace(" ", "-"))
            targets.append(peers.Target(name, [gw], lambda proc=proc: peers.tree(proc.pid)))
            bodies[name] = (BODY.replace(b'"m"', f'"{model}"'.encode()), SBODY.replace(b'"m"', f'"{model}"'.encode()))

        print(f"gateway overhead: {os.cpu_count()} cores shared by wrk, the proxies and 2 fast fake engines; "
              f"{a.seconds:g}s per cell; llmgw with {workers} gevent worker(s)")
        for case, body, conns in CASES:
            print(f"\n{case}")
            print(f"  {'target':22} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'+p50':>6} {'+p99':>6} {'cpu/req':>8} "
                  f"{'x router':>8} {'rps x router':>12} {'errors':>6}")
            rows = []
            for t in targets:
                for warm in (True, False):
                    pids = t.pids() if t.pids else []
                    cpu0 = peers.cpu_seconds(pids)
                    b = bodies.get(t.name, (BODY, SBODY))[0 if body is BODY else 1]
                    r = wrk.run(t.urls[0], b, conns, 1.0 if warm else a.seconds)
                    cpu = (peers.cpu_seconds(pids) - cpu0) / max(1, r.requests) if pids else None
                rows.append((t.name, r, cpu))
            direct = next((r for n, r, _ in rows if n == "direct"), None)
            router = next(((r, c) for n, r, c in rows if n == "vllm-router"), None)
            for name, r, cpu in rows:
                add50 = f"{(r.p50 - direct.p50) * 1000:.2f}" if direct and name != "direct" else "-"
                add99 = f"{(r.p99 - direct.p99) * 1000:.2f}" if direct and name != "direct" else "-"
                c = f"{cpu * 1000:.3f}" if cpu is not None else "-"
                xr = f"{cpu / router[1]:.2f}" if cpu is not None and router and router[1] else "-"
                xrps = f"{r.rps / router[0].rps:.2f}" if router and router[0].rps else "-"
                print(f"  {name:22} {r.rps:>8.0f} {pct_ms(r.p50):>7} {pct_ms(r.p99):>7} {add50:>6} {add99:>6} "
                      f"{c:>8} {xr:>8} {xrps:>12} {r.errors:>6}", flush=True)
        if a.profile and any(t.name == "llmgw" for t in targets):
            t = next(t for t in targets if t.name == "llmgw")
            worker = [p for p in t.pids() if p != t.pids()[0]][0]
            for case, body in (("json c32", BODY), ("sse c32", SBODY)):
                print(f"\nprofile of one llmgw worker (pid {worker}), {case}:")
                print(profile(worker, a.seconds, t.urls[0], body, 32))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
