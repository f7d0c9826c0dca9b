"""How many concurrent streams the gateway holds: closed loop at 64, 256, 1,024 and 4,096 concurrent
streams, side by side with the engines called directly, with nginx `least_conn`, vLLM's router
(`vllm-router`, round robin; pip extra `bench`) and (when asked for) LiteLLM's proxy `least-busy`
(bench/litellm_peer.py) in front of them.

    python -m bench.streams [--levels 64,256,1024,4096] [--seconds 8] [--quick] [--at-once]
                            [--targets direct,nginx,vllm-router,llmgw,litellm]

Two fast fake engines (bench/fast_engine.py: asyncio, a slot for every stream) answer each request
with 8 SSE events over ~1.6 s (64 tokens, one event per 8 tokens). Each level runs every target in
turn; the load generator is an asyncio client on raw keep-alive sockets in its own process, each
simulated user sending its next request as soon as the last one ended. Printed per level and target:
requests/s, time to first token and latency (p50/p99), errors, and for the proxies their CPU time
per request (user + system of all their processes, from /proc/<pid>/stat) and their RSS (the most
seen while the level ran). A target that fails requests gets its statuses and last error printed on
its row, and the run goes on. The `direct` column shows what the client and the engines manage on
their own on this machine: a proxy cannot beat it. Starts everything itself and stops it all.

Users start spread over one answer time and are measured once all are in their loop; `--at-once`
starts every user at the same moment instead, one new connection each, and measures from that moment
(the burst and one answer time plus `--seconds` after it): a proxy whose listen queue overflows
drops SYNs, and those clients wait out the kernel's retransmit backoff (1 s, 3 s, 7 s, ...): a request
on a new connection is timed from its connect, so that wait is in its time to first token. Each row
also prints the kernel's counters over its run (this network namespace's `TcpExtListenOverflows`,
`TcpExtListenDrops` and `TcpExtTCPTimeouts`, from /proc/net/netstat): `ovf`, `drops`, `rto`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import litellm_peer
from bench.peers import cpu_seconds, start_engines, start_nginx, start_vllm_router, tree

ROOT = Path(__file__).resolve().parent.parent

ANSWER_S = 1.6  # seconds per answer: 64 tokens at 40 tokens/s
EVENTS = 8  # one SSE event per 8 tokens
BODY = json.dumps({"model": "m", "stream": True, "max_tokens": 64,
                   "messages": [{"role": "user", "content": "tell me something"}]}).encode()


# --- the load generator (its own process: `python -m bench.streams --client '<json>'`) --------------
def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


class Stream(asyncio.Protocol):
    """One keep-alive connection sending a streamed request and reading the chunked answer; the end
    of an answer is the terminating zero-length chunk."""

    def __init__(self, loop):
        self.loop = loop
        self.transport = None
        self.done: asyncio.Future | None = None
        self.buf = b""
        self.t0 = self.first = 0.0
        self.status = 0
        self.connected = loop.create_future()

    def connection_made(self, transport):
        self.transport = transport
        self.connected.set_result(True)

    def send(self, request: bytes) -> asyncio.Future:
        self.done = self.loop.create_future()
        self.buf, self.first, self.status = b"", 0.0, 0
        self.t0 = time.perf_counter()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes):
        if self.status == 0:
            self.buf += data
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            self.status = int(self.buf[9:12])
            data = self.buf[head_end + 4:]
            self.buf = b""
        if not self.first and data:
            self.first = time.perf_counter()
        self.buf = (self.buf + data)[-16:]
        if self.buf.endswith(b"0\r\n\r\n") and self.done is not None and not self.done.done():
            self.done.set_result(True)

    def connection_lost(self, exc):
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc!r}"))


async def user(i: int, urls: list[str], start_at: float, stop_at: float, measure_from: float, out: dict) -> None:
    loop = asyncio.get_running_loop()
    host, port = urls[i % len(urls)].split("//")[1].split(":")
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(BODY), BODY))
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    proto = None
    while time.perf_counter() < stop_at:
        began = None  # a new connection's request is timed from its connect (a dropped SYN waits there)
        try:
            if proto is None or proto.transport.is_closing():
                began = time.perf_counter()
                _, proto = await loop.create_connection(lambda: Stream(loop), host, int(port))
            await asyncio.wait_for(proto.send(request), 120)
            if began is not None:
                proto.t0 = began
            ok = proto.status == 200
        except (OSError, asyncio.TimeoutError, ConnectionError) as e:
            ok = False
            out["last_error"] = repr(e)
            if proto is not None and proto.transport is not None:
                proto.transport.close()
            proto = None
            await asyncio.sleep(0.05)
        end = time.perf_counter()
        if measure_from <= end <= stop_at:  # every answer that ended within the measured window
            if ok:
                out["ttft"].append(proto.first - proto.t0)
                out["lat"].append(end - proto.t0)
            else:
                out["errors"] += 1
                status = proto.status if proto is not None else 0
                out["statuses"][status] = out["statuses"].get(status, 0) + 1
    if proto is not None:
        proto.transport.close()


async def client_main(a: dict) -> dict:
    n, urls, seconds = a["concurrency"], a["urls"], a["seconds"]
    now = time.perf_counter()
    if a.get("at_once"):
        # Every user opens its connection at this moment, and the burst is measured with the rest.
        ramp, measure_from = 0.0, now
        seconds += a["answer"]
    else:
        # Users start spread evenly over one answer time: connections do not all open at once, and the
        # answers end at evenly spread times (clustered ends would bias the count in a short window).
        ramp = a["answer"]
        measure_from = now + ramp + a["answer"]  # every user is in its steady loop
    stop_at = measure_from + seconds
    out = {"ttft": [], "lat": [], "errors": 0, "statuses": {}, "last_error": ""}
    rng = random.Random(1)
    print(json.dumps({"measure_from_in": measure_from - now, "seconds": seconds}), flush=True)
    await asyncio.gather(*(user(i, urls, now + ramp * (i + rng.random()) / n, stop_at, measure_from, out)
                           for i in range(n)))
    lat, ttft = out["lat"], out["ttft"]
    return {"rps": len(lat) / seconds, "requests": len(lat), "errors": out["errors"], "statuses": out["statuses"],
            "last_error": out["last_error"], "ttft50": pct(ttft, .5), "ttft99": pct(ttft, .99),
            "lat50": pct(lat, .5), "lat99": pct(lat, .99)}


def client(arg: str) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(json.dumps(asyncio.run(client_main(json.loads(arg)))), flush=True)


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            pass
    return total


# --- the run -----------------------------------------------------------------------------------------------
KERNEL = ("ListenOverflows", "ListenDrops", "TCPTimeouts")  # TcpExt counters printed per row


def tcp_ext() -> dict[str, int]:
    """This network namespace's TcpExt counters (/proc/net/netstat: a names line, then a values line)."""
    try:
        lines = [ln.split() for ln in open("/proc/net/netstat") if ln.startswith("TcpExt:")]
        return {k: int(v) for k, v in zip(lines[0][1:], lines[1][1:])}
    except (OSError, IndexError, ValueError):
        return {}


def run_level(urls: list[str], n: int, seconds: float, answer: float, pids_of, at_once: bool = False) -> dict:
    """One closed-loop run; samples the proxy's CPU time over the measured window and its RSS, and the
    kernel's TCP counters over the whole run."""
    k0 = tcp_ext()
    proc = subprocess.Popen([sys.executable, "-m", "bench.streams", "--client", json.dumps(
        {"concurrency": n, "urls": urls, "seconds": seconds, "answer": answer, "at_once": at_once})],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    head = json.loads(proc.stdout.readline())
    pids = pids_of() if pids_of else []
    rss = [0]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.25):
            rss[0] = max(rss[0], rss_bytes(pids))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(head["measure_from_in"])
    cpu0 = cpu_seconds(pids)
    time.sleep(head["seconds"])
    cpu1 = cpu_seconds(pids)
    res = json.loads(proc.stdout.readline())
    k1 = tcp_ext()
    res["kernel"] = {k: k1[k] - k0[k] for k in KERNEL if k in k0 and k in k1}
    proc.wait()
    stop.set()
    sampler.join()
    res["cpu_ms"] = (cpu1 - cpu0) * 1000 / res["requests"] if pids and res["requests"] else None
    res["rss_mb"] = rss[0] / 2**20 if pids else None
    return res


def fmt(r: dict) -> str:
    cpu = f"{r['cpu_ms']:.2f}" if r["cpu_ms"] is not None else "-"
    rss = f"{r['rss_mb']:.0f}" if r["rss_mb"] is not None else "-"
    k = r.get("kernel") or {}
    kern = " ".join(f"{k[c]:>6}" if c in k else f"{'-':>6}" for c in KERNEL)
    return (f"{r['rps']:>7.1f} {r['ttft50'] * 1000:>7.0f} {r['ttft99'] * 1000:>7.0f} {r['lat50'] * 1000:>7.0f} "
            f"{r['lat99'] * 1000:>7.0f} {r['errors']:>6} {cpu:>7} {rss:>7} {kern}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="64,256,1024,4096", help="concurrent streams, comma-separated")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per level and target")
    ap.add_argument("--targets", default="direct,nginx,vllm-router,llmgw",
                    help="of direct, nginx, vllm-router, llmgw, litellm (LiteLLM's proxy, its own virtualenv made on first use), "
                    "floor-gunicorn, floor-gevent (a stream with no proxying: bench/stream_floor.py), floor-proxy (the "
                         "gateway's server model and engine client passing streams through, nothing else: bench/floor.py)")
    ap.add_argument("--workers", type=int, default=0, help="gateway workers (default: the conf's, one per core)")
    ap.add_argument("--answer", type=float, default=ANSWER_S, help="seconds per answer")
    ap.add_argument("--quick", action="store_true", help="64 and 256 streams, 4 s each")
    ap.add_argument("--at-once", action="store_true", help="every user connects at the same moment, measured "
                    "from then (else they start spread over one answer time and are measured once all run)")
    ap.add_argument("--client", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        return client(a.client)
    if a.quick:
        a.levels, a.seconds = "64,256", 4.0
    levels = [int(x) for x in a.levels.split(",")]
    targets = a.targets.split(",")
    known = ("direct", "nginx", "vllm-router", "llmgw", "litellm", "floor-gunicorn", "floor-gevent", "floor-proxy")
    unknown = [t for t in targets if t not in known]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(known)}")

    from llmgw.state.records import EndpointInfo
    from harness.cluster import Cluster
    from harness.procs import free_port, wait_until

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-streams-"))
    cluster = Cluster(workdir)
    try:
        cluster.start_redis()
        engines = start_engines(cluster.procs, 2, a.answer, EVENTS, wait_until, free_port)
        cluster.store().write_endpoints(
            [EndpointInfo(id=f"e{i}", url=u, models=("m",), engine="sim", model="m", served_name="m")
             for i, u in enumerate(engines)], "bench", time.time())
        urls = {"direct": (engines, None)}
        if "nginx" in targets:
            port = free_port()
            ng = start_nginx(cluster.procs, workdir, engines, port, least_conn=True)
            if ng is None:
                print("nginx is not installed: its column is skipped")
                targets.remove("nginx")
            else:
                import requests

                url = f"http://127.0.0.1:{port}"
                wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 10, what="nginx")
                urls["nginx"] = ([url], lambda: tree(ng.pid))
        if "vllm-router" in targets:
            import requests

            port = free_port()
            vr = start_vllm_router(cluster.procs, engines, port, free_port)
            if vr is None:
                print("vllm-router not found (pip install -e '.[bench]'): its column is skipped")
                targets.remove("vllm-router")
            else:
                url = f"http://127.0.0.1:{port}"
                wait_until(lambda: requests.get(url + "/v1/models", timeout=1).ok, 60, what="vllm-router")
                urls["vllm-router"] = ([url], lambda: tree(vr.pid))
        if "llmgw" in targets:
            env = {"LLMGW_GATEWAY_WORKERS": str(a.workers)} if a.workers else {}
            gw = cluster.start_gateway(**{"LLMGW_GATEWAY_WORKERS": str(a.workers or os.cpu_count() or 1), **env})
            wait_until(lambda: __import__("requests").get(gw + "/readyz", timeout=1).ok, 20, what="gateway ready")
            gproc = cluster.procs.get("gateway")
            urls["llmgw"] = ([gw], lambda: tree(gproc.pid))
        for floor in [t for t in targets if t.startswith("floor-")]:  # bench/stream_floor.py
            port = free_port()
            env = {"FLOOR_ANSWER_S": str(a.answer), "FLOOR_EVENTS": str(EVENTS), "PYTHONPATH": str(ROOT),
                   "FLOOR_ENGINES": ",".join(engines)}
            if floor in ("floor-gunicorn", "floor-proxy"):  # the latter: bench/floor.py, through the engines
                app = "bench.stream_floor:app" if floor == "floor-gunicorn" else "bench.floor:proxy"
                argv = [str(Path(sys.executable).parent / "gunicorn"), "-c", "python:gateway.gunicorn_conf",
                        "-b", f"127.0.0.1:{port}", "--worker-connections", str(2 * max(levels)),
                        "-w", str(a.workers or os.cpu_count() or 1), app]
            else:
                argv = [sys.executable, "-m", "bench.stream_floor", str(port)]
            fp = cluster.procs.start(floor, argv, env=env, cwd=ROOT)
            furl = f"http://127.0.0.1:{port}"
            wait_until(lambda: _answers(furl), 20, what=floor)
            urls[floor] = ([furl], lambda fp=fp: tree(fp.pid))
        if "litellm" in targets:
            py = litellm_peer.python()
            if py is None:
                targets.remove("litellm")
            else:
                # No max_parallel_requests: llmgw is not told a capacity here either (every stream has a slot).
                port = free_port()
                cfg = litellm_peer.config(engines, "m", [None] * len(engines))
                lt = litellm_peer.start(cluster.procs, "litellm", workdir, py, cfg, port,
                                        a.workers or os.cpu_count() or 1)  # as many workers as the gateway
                urls["litellm"] = ([f"http://127.0.0.1:{port}"], lambda: tree(lt.pid))
        print(f"streams: {os.cpu_count()} cores ({_cpu_model()}) shared by client, proxies and 2 fake engines; "
              f"{EVENTS} SSE events over {a.answer}s per answer; closed loop, "
              + (f"every user connecting at once, measured from then for {a.answer + a.seconds:.1f}s per cell"
                 if a.at_once else f"{a.seconds:.0f}s measured per cell"))
        print(f"{'streams':>7} {'target':14} {'req/s':>7} {'ttft50':>7} {'ttft99':>7} {'lat50':>7} {'lat99':>7} "
              f"{'errors':>6} {'cpu ms':>7} {'rss MB':>7} {'ovf':>6} {'drops':>6} {'rto':>6}")
        for n in levels:
            for t in targets:
                target_urls, pids_of = urls[t]
                r = run_level(target_urls, n, a.seconds, a.answer, pids_of, a.at_once)
                print(f"{n:>7} {t:14} {fmt(r)}" + (f"  ({r['statuses']} {r['last_error']})" if r["errors"] else ""),
                      flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _answers(url: str) -> bool:
    import requests

    try:
        return requests.post(url + "/v1/chat/completions", data=BODY, timeout=10).ok
    except requests.RequestException:
        return False


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
