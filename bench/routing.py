"""Routing on real processes: llmgw against its peers on several fleets and loads, side by side.

    python -m bench.routing [--quick] [--fleets fleet-a,...] [--loads 0.5,0.8,0.95,burst]
                            [--routers llmgw,least_inflight,...] [--seconds 8] [--plot docs/routing-p99.png]
                            [--make vllm|llamacpp] [--workload random|conversations|mix]

Fleets are bench/fleets.py's (the simulator and this benchmark share their definitions): simulated
engines (`python -m simengine`) with continuous batching, a decode step that slows with the
batch, and speeds; one of them drops to 30 % of its speed in the middle of each measured run of the
`slowing` fleet. Routers, each in front of the same engines in turn:
- llmgw's gateway under gunicorn (gateway/gunicorn_conf.py), endpoints published with the engines'
  batch size as `capacity`, loads scraped every second by the agent's own scraper; with its policy
  (`llmgw`) and its two baselines (`least_inflight`, `round_robin`, LLMGW_GATEWAY_POLICY);
- nginx `least_conn` (when /usr/sbin/nginx or nginx on PATH exists), its own config in a temp dir;
- vLLM's router (`vllm-router`, pip extra `bench`) with `power_of_two` and `cache_aware`;
- LiteLLM's proxy (`litellm`, bench/litellm_peer.py: its own virtualenv, made on first use) with
  `least-busy`, one deployment per engine with the engine's batch size as `max_parallel_requests`
  (llmgw is told the same as `capacity`), as many workers as llmgw's gateway.
The load is open loop (asyncio, harness/loadgen.py): Poisson arrivals at 50/80/95 % of the
fleet's capacity, and `burst`: 80 %, then 10 s at 150 %, then 80 % again; streamed chat requests
of ~100-token prompts (random words, so no prefix cache helps) and the fleet's output lengths.
Each router gets a short unmeasured warm-up. Figures per cell: p50/p90/p99 latency, TTFT p50/p99,
the router's CPU per request (`cpu_ms`: user + system of its process tree, from /proc), errors (non-200, broken streams, or no answer within 60 s, a client's usual timeout), and the share
each engine served (from the answers' `system_fingerprint`). Starts everything itself on loopback
and stops it all. The full matrix took 35 minutes on 2 busy shared cores (before LiteLLM joined),
`--quick` about 4 with every peer.

`--make llamacpp` runs the engines in llama.cpp's personality (`--metrics-style llamacpp`: slots that
keep one prompt each, llama-server's /metrics, nothing sent before the first token) instead of vLLM's.
`--workload conversations` (or `mix`, with one-shot requests) sends bench/prefix.py's sessions over
shared system prompts (bench/conversations.py) at the load's share of the fleet's capacity for them
(no burst); either option adds the fleet's hit ratio from the engines' counters beside the latencies.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench import conversations as conv
from bench import litellm_peer
from bench.fleets import FLEETS, HELD_OUT, LOADS, Engine, Fleet, Load
from bench.peers import cpu_seconds, tree
from bench.report import pct
from bench.traffic import CHAT, CLIENT_TIMEOUT, run_traffic
from llmgw.state.records import EndpointInfo
from llmgw.state.clock import Clock
from harness.cluster import Cluster
from harness.loadgen import StreamResult, open_loop_streams, poisson_times
from harness.procs import bin_path, free_port, python, wait_until

ROUTERS = ("llmgw", "least_inflight", "round_robin", "nginx", "vllm-p2", "vllm-cache", "litellm")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


def nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


# --- the fleet --------------------------------------------------------------------------------------
def engine_argv(e: Engine, port: int, make: str = "vllm") -> list[str]:
    c = e.sim
    argv = [python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m",
            "--max-seqs", str(c.max_seqs), "--kv-tokens", str(c.kv_tokens), "--step-ms", str(c.step_ms),
            "--batch-alpha", str(c.batch_alpha), "--prefill-ms-per-token", str(c.prefill_ms_per_token),
            "--speed", str(c.speed), "--seed", "1"]
    if c.slow_to < 1:
        argv += ["--slow-to", str(c.slow_to), "--slow-after", str(c.slow_after)]
    return argv + make_args(make)


def make_args(make: str) -> list[str]:
    """The sim engine's args for the make (vLLM's is its default); also the profile the scraper maps
    that engine's /metrics by."""
    return [] if make == "vllm" else ["--metrics-style", make]


class RunningFleet:
    """The fleet's engines, published to Redis for llmgw, and the agent's scraper writing their loads."""

    def __init__(self, cluster: Cluster, fleet: Fleet, tag: str, kv_events: bool = False):
        """`kv_events`: the engines publish vLLM's KV events and the list says where (precise mode)."""
        self.cluster, self.fleet = cluster, fleet
        self.ports = {e.name: free_port() for e in fleet.engines}
        self.kv = {e.name: (free_port(), free_port()) for e in fleet.engines} if kv_events else {}
        self.names = [e.name for e in fleet.engines]
        for e in fleet.engines:
            kv = self.kv.get(e.name)
            extra = ["--kv-events-endpoint", f"tcp://*:{kv[0]}", "--kv-events-replay-endpoint", f"tcp://*:{kv[1]}"] \
                if kv else []
            cluster.procs.start(f"engine-{e.name}-{tag}", engine_argv(e, self.ports[e.name], fleet.make) + extra,
                                env=cluster.env())
        self.urls = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}
        import requests

        for n, u in self.urls.items():
            wait_until(lambda u=u: requests.get(u + "/health", timeout=1).ok, 30, what=f"engine {n}")
        cluster.store().write_endpoints(
            [EndpointInfo(id=e.name, url=self.urls[e.name], models=("m",), engine="sim", model="m", served_name="m",
                          capacity=e.capacity, **self._kv_addresses(e.name)) for e in fleet.engines],
            f"bench-{tag}", time.time())
        self.stop_scrape = threading.Event()
        self.scraper = threading.Thread(target=self._scrape, name="bench-scrape", daemon=True)
        self.scraper.start()
        self._wait_for_loads()

    def _wait_for_loads(self) -> None:
        """Until every engine has a scrape that read its /metrics: a scraper that fails (an engine's
        metrics the mapping cannot read) would leave llmgw routing without loads, and the figures
        would not say so."""
        store = self.cluster.store()

        def scraped() -> bool:
            loads = store.loads(self.names)
            return all(r is not None and r.ok for r in (loads.get(n) for n in self.names))

        try:
            wait_until(scraped, 15, interval=0.1, what="the engines' first good scrapes")
        except Exception:
            loads = store.loads(self.names)
            bad = {n: (r.error if r is not None else "no record") for n in self.names
                   if (r := loads.get(n)) is None or not r.ok}
            self.stop()
            raise RuntimeError(f"the engines' loads are not being scraped: {bad}") from None

    def _kv_addresses(self, name: str) -> dict[str, str]:
        kv = self.kv.get(name)
        return {"kv_events": f"tcp://127.0.0.1:{kv[0]}", "kv_replay": f"tcp://127.0.0.1:{kv[1]}"} if kv else {}

    def _scrape(self) -> None:
        """The node agent's scraper (workers/agent/scrape.py), every second, as on a real node."""
        from workers.agent.probe import HttpProber
        from workers.agent.scrape import Scraper, ScrapeTarget

        profile = None
        if self.fleet.make != "vllm":
            from llmgw.catalog.types import Profile

            profile = Profile(name="bench", engine="sim", args=make_args(self.fleet.make))
        targets = [ScrapeTarget(n, u + "/metrics", "sim", profile) for n, u in self.urls.items()]
        cfg = types.SimpleNamespace(scrape_interval=1.0, scrape_timeout=1.0)
        Scraper(self.cluster.store(), HttpProber(), lambda: targets, cfg, Clock()).run(self.stop_scrape)

    def counters(self) -> dict[str, tuple[float, float]]:
        """Each engine's (prompt tokens found cached, looked up), from its own /metrics."""
        import requests

        return {n: conv.metrics_counters(requests.get(u + "/metrics", timeout=5).text, self.fleet.make)
                for n, u in self.urls.items()}

    def engine_of(self, fingerprint: str) -> str:
        port = fingerprint.rsplit("-", 1)[-1]
        return next((n for n, p in self.ports.items() if str(p) == port), "?")

    def stop(self) -> None:
        self.stop_scrape.set()
        self.scraper.join(5)
        for p in self.cluster.procs.procs:
            if p.name.startswith("engine-") and p.alive():
                p.stop()


# --- the routers ------------------------------------------------------------------------------------
class Router:
    def __init__(self, kind: str, cluster: Cluster, fleet: RunningFleet, workdir: Path, gateway_workers: str | None):
        self.kind, self.cluster = kind, cluster
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"router-{kind}-{self.port}"
        urls = list(fleet.urls.values())
        import requests

        if kind in ("llmgw", "least_inflight", "round_robin"):
            env = cluster.env(LLMGW_GATEWAY_POLICY=kind, LLMGW_GATEWAY_SEED="1", LLMGW_GATEWAY_BIND=f"127.0.0.1:{self.port}",
                              LLMGW_GATEWAY_THREADS="1024")  # a burst holds hundreds of requests at once
            if gateway_workers:
                env["LLMGW_GATEWAY_WORKERS"] = gateway_workers
            cluster.procs.start(self.name, [bin_path("gunicorn"), "-c", "python:gateway.gunicorn_conf",
                                            "--log-level", "warning", "gateway:create_app()"], env=env, cwd=str(ROOT))
            wait_until(lambda: requests.get(self.url + "/healthz", timeout=1).json()["endpoints"] == len(urls), 30,
                       what=f"{kind} gateway")
        elif kind == "nginx":
            conf = workdir / f"nginx-{self.port}.conf"
            servers = "\n".join(f"    server {u[len('http://'):]} max_fails=0;" for u in urls)
            conf.write_text(f"""daemon off;
worker_processes 1;
pid {workdir}/nginx-{self.port}.pid;
error_log {workdir}/nginx-{self.port}.err warn;
events {{ worker_connections 16384; }}
http {{
  access_log off;
  # Request bodies stay in memory: past the default 16k buffer nginx writes them to a temp file, which
  # its workers (user nobody when started as root) cannot create in the private temp dir: a 500.
  client_body_buffer_size 16m;
  client_max_body_size 16m;
  client_body_temp_path {workdir}/nginx-body;
  proxy_temp_path {workdir}/nginx-proxy;
  upstream fleet {{
    least_conn;
{servers}
    keepalive 256;
  }}
  server {{
    listen 127.0.0.1:{self.port};
    location / {{
      proxy_pass http://fleet;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
""")
            cluster.procs.start(self.name, [nginx_binary(), "-p", str(workdir), "-c", str(conf)])
            wait_until(lambda: requests.get(self.url + "/health", timeout=1).status_code == 200, 15, what="nginx")
        elif kind == "litellm":
            cfg = litellm_peer.config(urls, "m", [e.capacity for e in fleet.fleet.engines])
            litellm_peer.start(cluster.procs, self.name, workdir, litellm_peer.python(), cfg, self.port,
                               int(gateway_workers or os.cpu_count() or 1))  # llmgw's gateway: one per core
        else:
            policy = {"vllm-p2": "power_of_two", "vllm-cache": "cache_aware"}[kind]
            # Its metrics port too: the default 29000 is taken by any other vllm-router or smg on the
            # machine, and the second one then panics at start ("Address already in use").
            cluster.procs.start(self.name, [bin_path("vllm-router"), "--host", "127.0.0.1", "--port", str(self.port),
                                            "--worker-urls", *urls, "--policy", policy, "--log-level", "warning",
                                            "--prometheus-port", str(free_port())])
            wait_until(lambda: requests.get(self.url + "/v1/models", timeout=1).status_code == 200, 60,
                       what=f"vllm-router {policy}")

    def stop(self) -> None:
        self.cluster.procs.get(self.name).stop()

    def pids(self) -> list[int]:
        """The router's processes (gunicorn's master and workers, nginx's), for its CPU time."""
        return tree(self.cluster.procs.get(self.name).popen.pid)


# --- one cell ---------------------------------------------------------------------------------------
@dataclass
class Cell:
    fleet: str
    load: str
    router: str
    results: list[StreamResult]
    shares: dict[str, int]
    cpu_ms: float | None = None  # the router's CPU (its process tree, user + system) per request
    hits: float | None = None  # the fleet's hit ratio from the engines' counters, when shown

    def ok(self) -> list[StreamResult]:
        return [r for r in self.results if r.status == 200]

    def figures(self) -> dict:
        ok = self.ok()
        lat, ttft = [r.latency for r in ok], [r.ttft for r in ok if r.ttft is not None]
        return {"p50": pct(lat, .5), "p90": pct(lat, .9), "p99": pct(lat, .99), "ttft50": pct(ttft, .5),
                "ttft99": pct(ttft, .99), "errors": len(self.results) - len(ok), "n": len(self.results)}


def bodies(fleet: Fleet, n: int, seed: int) -> list[bytes]:
    """Chat requests with prompts of the fleet's length (about 4 characters per token) made of random
    words, and its output lengths as max_tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_tokens, max_tokens = fleet.prompt.sample(rng), fleet.output.sample(rng)
        words, chars = [], 0
        while chars < 4 * max(1, prompt_tokens - 6):
            w = rng.choice(WORDS)
            words.append(w)
            chars += len(w) + 1
        out.append(json.dumps({"model": "m", "stream": True, "max_tokens": max_tokens,
                               "messages": [{"role": "user", "content": " ".join(words)}]}).encode())
    return out


def drive(url: str, fleet: Fleet, load: Load, seed: int, workload: str = "random") -> list[StreamResult]:
    if workload != "random":  # bench/prefix.py's sessions and client; its results have the same fields
        _, convs = conv.sized(fleet, workload, load.fraction, load.seconds, seed)
        return run_traffic(url, convs)
    cap = fleet.capacity()
    times = poisson_times(load.rate_at(cap), load.peak(cap), load.seconds, seed)
    return open_loop_streams(url, CHAT, bodies(fleet, len(times), seed), times, timeout=CLIENT_TIMEOUT)


def run_fleet(cluster: Cluster, fleet: Fleet, loads: list[Load], routers: list[str], workdir: Path, warmup: float,
              gateway_workers: str | None, workload: str = "random", hits: bool = False) -> list[Cell]:
    """Every router in front of the fleet for every load, one router at a time. The engines are
    started once, or once per run when one of them slows mid-run (so each run sees the slowdown at
    the same point); each router gets an unmeasured warm-up when it starts."""
    cells: list[Cell] = []
    restart = any(e.sim.slow_to < 1 for e in fleet.engines)
    rf = None
    try:
        for kind in routers:
            router = None
            try:
                for i, load in enumerate(loads):
                    if router is None or restart:
                        if router is not None:
                            router.stop()
                        if rf is None or restart:
                            if rf is not None:
                                rf.stop()
                            # The slowdown counts from an engine's first request (the warm-up's): put it in
                            # the middle of the measured run, however long the run is.
                            mid = {"slow_after": warmup + load.seconds / 2} if restart else {}
                            run_fleet_ = replace(fleet, engines=tuple(
                                replace(e, sim=replace(e.sim, **mid)) if e.sim.slow_to < 1 else e
                                for e in fleet.engines))
                            rf = RunningFleet(cluster, run_fleet_, f"{fleet.name}-{kind}-{i}")
                        router = Router(kind, cluster, rf, workdir, gateway_workers)
                        drive(router.url, fleet, replace(load, name="warm-up", seconds=warmup, burst_seconds=0,
                                                         fraction=min(load.fraction, 0.8)), seed=99)
                    pids = router.pids()
                    cpu0 = cpu_seconds(pids)
                    before = rf.counters() if hits else {}
                    results = drive(router.url, fleet, load, seed=1, workload=workload)
                    cpu_ms = (cpu_seconds(pids) - cpu0) * 1000 / len(results) if pids and results else None
                    ratio = conv.hit_ratio(before, rf.counters()) if hits else None
                    shares = {n: 0 for n in rf.names}
                    for r in results:
                        if r.status == 200:
                            n = rf.engine_of(r.server)
                            shares[n] = shares.get(n, 0) + 1
                    cells.append(Cell(fleet.name, load.name, kind, results, shares, cpu_ms, ratio))
                    print(row(cells[-1]), flush=True)
            finally:
                if router is not None:
                    router.stop()
    finally:
        if rf is not None:
            rf.stop()
    return cells


def row(c: Cell) -> str:
    f = c.figures()
    share = "/".join(str(v) for v in c.shares.values())
    failed: dict[int, int] = {}  # what the errors were: HTTP status, 0 for no answer or a broken stream
    for r in c.results:
        if r.status != 200:
            failed[r.status] = failed.get(r.status, 0) + 1
    cpu = f"{c.cpu_ms:7.2f}" if c.cpu_ms is not None else f"{'-':>7}"
    hits = f" {100 * c.hits:5.1f}%" if c.hits is not None else ""  # only beside the default table's columns
    return (f"  {c.load:6} {c.router:15} {f['p50']:7.2f} {f['p90']:7.2f} {f['p99']:7.2f} {f['ttft50']:7.3f} "
            f"{f['ttft99']:7.3f}{hits} {cpu} {f['errors']:5}/{f['n']:<5} {share}"
            + (f"  (statuses {failed})" if failed else ""))


def verdict(cells: list[Cell]) -> list[str]:
    """Per fleet and load: llmgw's p99 and TTFT p99 over the best peer's (llmgw's baselines included)."""
    out = []
    keys = sorted({(c.fleet, c.load) for c in cells}, key=lambda k: [c.fleet for c in cells].index(k[0]))
    for fleet, load in keys:
        group = {c.router: c.figures() for c in cells if (c.fleet, c.load) == (fleet, load)}
        if "llmgw" not in group or len(group) < 2:
            continue
        mine = group.pop("llmgw")
        best99 = min(g["p99"] for g in group.values())
        bestt = min(g["ttft99"] for g in group.values())
        p, t = mine["p99"] / best99, mine["ttft99"] / bestt
        flag = "" if p <= 1 and t <= 1 and mine["errors"] <= min(g["errors"] for g in group.values()) else "  <-- behind"
        out.append(f"  {fleet:12} {load:6} {p:5.2f} {t:5.2f} {mine['errors']:4}{flag}")
    return out


def plot(points: list[tuple[str, str, str, float]], path: Path) -> None:
    """`points`: (fleet, load, router, p99 seconds); one panel per fleet, one line per router."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not found (pip install -e '.[bench]'): no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = list(dict.fromkeys(p[0] for p in points))
    fig, axes = plt.subplots(1, len(fleets), figsize=(4.2 * len(fleets), 3.6), squeeze=False)
    for ax, fleet in zip(axes[0], fleets):
        mine = [p for p in points if p[0] == fleet]
        loads = list(dict.fromkeys(p[1] for p in mine))
        for router in dict.fromkeys(p[2] for p in mine):
            ys = [next((p[3] for p in mine if p[2] == router and p[1] == ld), float("nan")) for ld in loads]
            ax.plot(loads, ys, marker="o", label=router, linewidth=2.5 if router == "llmgw" else 1.2)
        ax.set_yscale("log")
        ax.set_title(fleet)
        ax.set_xlabel("load")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("p99 latency (s)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleets", default=",".join(FLEETS),
                    help=f"subset of {', '.join(FLEETS)}, or of the held-out {', '.join(HELD_OUT)}")
    ap.add_argument("--loads", default=None,
                    help="subset of 0.5, 0.8, 0.95, burst (default all; --quick 0.8,burst; conversations: no burst)")
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"subset of {', '.join(ROUTERS)}")
    ap.add_argument("--seconds", type=float, default=None,
                    help="length of each Poisson load (default 6, --quick 3; the burst is 3+10+3 s, --quick 2+4+2)")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured traffic before each router's first load")
    ap.add_argument("--quick", action="store_true",
                    help="by default only fleet-a at 80 %% and a short burst, with 3 s loads (~3 min)")
    ap.add_argument("--gateway-workers", default=None, help="LLMGW_GATEWAY_WORKERS (default: the gunicorn config's)")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "routing-p99.png"), help="PNG of p99 vs load ('' for none)")
    ap.add_argument("--make", choices=conv.MAKES, default="vllm",
                    help="the engines' personality: vLLM's (default) or llama.cpp's (slots, its /metrics and "
                         "stream start)")
    ap.add_argument("--workload", choices=conv.WORKLOADS, default="random",
                    help="random prompts (default), or bench/prefix.py's sessions over shared system prompts: "
                         f"conversations, or mix ({100 * conv.MIX:.0f}%% one-shot requests); these take no burst")
    a = ap.parse_args(argv)
    talk = a.workload != "random"
    if a.quick:
        a.fleets = "fleet-a" if a.fleets == ",".join(FLEETS) else a.fleets
    if a.loads is None:
        a.loads = ("0.8" if a.quick else "0.5,0.8,0.95") + ("" if talk else ",burst")
    elif talk and "burst" in a.loads.split(","):
        ap.error("conversation workloads run at a steady rate: choose loads from 0.5, 0.8, 0.95")
    every_fleet = {**FLEETS, **HELD_OUT}
    for what, names, known in (("fleet", a.fleets, every_fleet), ("load", a.loads, LOADS), ("router", a.routers, ROUTERS)):
        unknown = [n for n in names.split(",") if n not in known]
        if unknown:
            ap.error(f"unknown {what}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    seconds = a.seconds or (3.0 if a.quick else 6.0)
    fleets = [replace(every_fleet[n], make=a.make) for n in a.fleets.split(",")]
    hits = talk or a.make != "vllm"  # the default run prints what it always did
    loads = []
    for name in a.loads.split(","):
        ld = LOADS[name]
        if name == "burst":
            quiet, burst = (2.0, 4.0) if a.quick else (3.0, 10.0)
            ld = replace(ld, seconds=2 * quiet + burst, burst_at=quiet, burst_seconds=burst, warmup=0)
        else:
            ld = replace(ld, seconds=seconds, warmup=0)
        loads.append(ld)
    routers = a.routers.split(",")
    if "nginx" in routers and not nginx_binary():
        print("nginx not found: its column is left out")
        routers.remove("nginx")
    if any(r.startswith("vllm") for r in routers) and not shutil.which(bin_path("vllm-router")):
        print("vllm-router not found (pip install -e '.[bench]'): its columns are left out")
        routers = [r for r in routers if not r.startswith("vllm")]
    if "litellm" in routers and not litellm_peer.python():
        routers.remove("litellm")

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-"))
    cluster = Cluster(workdir)
    cells: list[Cell] = []
    started = time.monotonic()
    try:
        cluster.start_redis()
        for fleet in fleets:
            cap = conv.sized(fleet, a.workload, 0.8, seconds, 1)[0].capacity() if talk else fleet.capacity()
            what = f", {a.workload} on {a.make} engines" if hits else ""
            print(f"\n{fleet.name}: {len(fleet.engines)} engines, speeds {[e.sim.speed for e in fleet.engines]}, "
                  f"capacity ~{cap:.1f} req/s{what}{(' (' + fleet.note + ')') if fleet.note else ''}")
            print(f"  {'load':6} {'router':15} {'p50':>7} {'p90':>7} {'p99':>7} {'ttft50':>7} {'ttft99':>7}"
                  f"{' ' + format('hits', '>6') if hits else ''} {'cpu_ms':>7} {'err/n':>11} "
                  f"served ({'/'.join(e.name for e in fleet.engines)})", flush=True)
            cells += run_fleet(cluster, fleet, loads, routers, workdir, a.warmup, a.gateway_workers, a.workload, hits)
        print("\nllmgw / best peer: p99 ratio, TTFT p99 ratio (<= 1 is the target), llmgw errors")
        print("\n".join(verdict(cells)))
        print(f"\n{len(cells)} cells in {time.monotonic() - started:.0f} s "
              f"({os.cpu_count()} cores shared by load generator, routers and engines)")
        if a.plot and cells:
            plot([(c.fleet, c.load, c.router, c.figures()["p99"]) for c in cells], Path(a.plot))
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
