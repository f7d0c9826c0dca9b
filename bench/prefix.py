"""Conversations with shared system prompts on engines with a prefix cache: llmgw against the
cache-aware peers, same run, side by side.

    python -m bench.prefix [--quick] [--routers llmgw,llmgw-kv,llmgw-2gw,nginx,vllm-cache,smg] [--conversations 80]
                           [--rate 2.0] [--mix 0.2] [--uneven] [--make vllm|llamacpp] [--seed 1]

The traffic: conversations of 3-8 turns, each over one of 24 system prompts of hundreds to thousands
of tokens; a conversation's next turn resends its whole history (the answers as received) after a
think time, and conversations start open loop (Poisson, `--rate` a second); `--mix` of the requests
are one-shot prompts that share nothing. All streamed. The fleet: 4 identical simulated engines in
vLLM's personality (`python -m simengine`: prefix cache of 16-token blocks within a KV budget shared
with running sequences, `vllm:prefix_cache_*` counters, head at once and role chunk with the first
token), or with `--uneven` speeds 2, 1, 1 and 0.5. Routers, each in front of freshly started engines
(cold caches, same traffic): llmgw's gateway as bench/routing.py starts it (redis, a static endpoint
list, the agent's scraper), `llmgw-kv` the same in precise mode (the engines publish vLLM's KV events
and the gateway routes by what each reports holding), `llmgw-2gw` two llmgw gateways (each its own
gunicorn, sharing nothing but Redis) behind round robin per request, as an L4 load balancer spreads
connections, nginx `least_conn`, vLLM's router `--policy cache_aware` and SGLang's
`smg launch --policy cache_aware` (pip extra `bench`), each when installed.

Printed per router: time to the first content token p50/p90/p99, end to end p50/p99, errors, the
fleet's prompt-token hit ratio from the engines' own counters (Δhits / Δqueries), each engine's
share of the requests, and how many of the conversations' later turns went to another engine than
their previous turn. A last row, `no queue`, is the floor under every router's TTFT: each request's
prefill that no routing can avoid (`floor`), on an idle engine. `--dump FILE` writes every
request's figures, llmgw's X-LLMGW-Prefix note included (its expected cost, backlog and rule), to
study a tail. The default run takes a few minutes; `--quick` is a smoke test.

`--real-vllm`: the same traffic on 2 real vLLM CPU replicas (the build `make vllm` prepares, SmolLM2-135M,
one core each: `VLLM_CPU_OMP_THREADS_BIND` 0 and 1, 1 GiB of KV each, prefix caching and KV events on),
started once (about 70 s) and their prefix caches emptied between routers (`POST /reset_prefix_cache`,
VLLM_SERVER_DEV_MODE). Routers: `llmgw-kv` (precise mode from the engines' KV events, the gateway reading
the model's tokenizer from its directory), `llmgw` (predicted from what it sent), `smg` cache_aware and
`round_robin` (llmgw's gateway with LLMGW_GATEWAY_POLICY=round_robin). Sized to 2 cores: 16
conversations at 0.25 a second, `--mix` 0.2 (about 4 minutes a router on an idle machine). Printed the
same way, but the engine that served each request is not known (vLLM names none in its answers, and
only llmgw says which endpoint it chose): `served` is each engine's count of finished requests, and
`moved` is left out; there is no `no queue` row (the sim's cost model does not describe vLLM).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench.fleets import Fleet, prefix_engines
from bench.report import pct
from bench.routing import Router, RunningFleet, nginx_binary
from bench.traffic import Conversation, Result, floor, run_traffic, workload
from harness.cluster import Cluster
from harness.procs import bin_path, free_port, wait_until

ROUTERS = ("llmgw", "llmgw-kv", "llmgw-2gw", "nginx", "vllm-cache", "smg")
REAL_ROUTERS = ("llmgw-kv", "llmgw", "smg", "round_robin")



# --- the peers this benchmark adds ------------------------------------------------------------------
class TwoGateways:
    """Two llmgw gateways over the same engines, each its own gunicorn (own indexes, own counts):
    they see each other only in the engines' scrapes, as gateways behind an L4 load balancer do."""

    def __init__(self, cluster: Cluster, fleet: RunningFleet, workdir: Path):
        self.gateways = [Router("llmgw", cluster, fleet, workdir, None) for _ in range(2)]
        self.url = [g.url for g in self.gateways]

    def stop(self) -> None:
        for g in self.gateways:
            g.stop()


class Smg:
    """SGLang's gateway (`smg launch`) with its cache-aware policy in front of the engines."""

    def __init__(self, cluster: Cluster, fleet: RunningFleet):
        import requests

        self.cluster, self.port = cluster, free_port()
        self.url, self.name = f"http://127.0.0.1:{self.port}", f"router-smg-{self.port}"
        cluster.procs.start(self.name, [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                                        "--worker-urls", *fleet.urls.values(), "--policy", "cache_aware",
                                        "--log-level", "warn",  # as vllm-router's: no log line per request
                                        # not the default 29000, which another smg or vllm-router may hold
                                        "--prometheus-port", str(free_port())])
        wait_until(lambda: requests.get(self.url + "/v1/models", timeout=1).status_code == 200, 60, what="smg")

    def stop(self) -> None:
        self.cluster.procs.get(self.name).stop()


def smg_binary() -> str | None:
    return shutil.which(bin_path("smg")) or shutil.which("smg")


def counters(urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    """Each engine's (prefix_cache_hits, prefix_cache_queries) from its /metrics."""
    import requests

    out = {}
    for name, u in urls.items():
        text = requests.get(u + "/metrics", timeout=5).text
        got = {m.group(1): float(m.group(2)) for m in
               re.finditer(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} (\S+)$", text, re.M)}
        out[name] = (got.get("hits", 0.0), got.get("queries", 0.0))
    return out


# --- real vLLM: its CPU build, two replicas on this machine -------------------------------------------
class RealVllmFleet:
    """Two real vLLM CPU replicas (what `make vllm` prepared), started once by the vllm engine driver's own
    command, published to Redis for llmgw's gateways (KV event addresses with `kv_events`), their loads
    scraped as the agent does; `reset()` empties their prefix caches between routers."""

    names = ["v0", "v1"]

    def __init__(self, cluster: Cluster):
        import requests

        from llmgw.catalog import Model, Profile
        from llmgw.engines.base import LaunchContext
        from llmgw.engines.selfcheck import VLLM_MODEL, VLLM_PYTHON
        from llmgw.engines.vllm import VllmDriver, prepared_env

        root = prepared_env(__import__("os").environ)
        if root is None or not (root / VLLM_PYTHON).is_file():
            raise SystemExit(f"--real-vllm needs vLLM's CPU build: run `make vllm` (looked in {root})")
        self.cluster, self.model_dir = cluster, str((root / VLLM_MODEL).resolve())
        self.ports = {n: free_port() for n in self.names}
        self.kv = {n: (free_port(), free_port()) for n in self.names}
        profile = Profile(name="cpu", engine="vllm", device="cpu", threads=1, kv_events=True,
                          args=["--max-model-len", "4096", "--max-num-seqs", "8"])
        model = Model(name="m", source=self.model_dir, profiles=[profile])
        driver = VllmDriver(environ={"LLMGW_VLLM_PYTHON": str(root / VLLM_PYTHON)})
        for core, n in enumerate(self.names):
            spec = driver.command(LaunchContext(replica_id=n, model=model, profile=profile, host="127.0.0.1",
                                                 port=self.ports[n], cpus=(core,), kv_events_port=self.kv[n][0],
                                                 kv_replay_port=self.kv[n][1]))
            cluster.procs.start(f"engine-{n}", list(spec.argv), env={**cluster.env(), **spec.env,
                                                                      "VLLM_SERVER_DEV_MODE": "1"})
        self.urls = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}
        started = time.monotonic()
        for n, u in self.urls.items():
            wait_until(lambda u=u: requests.get(u + "/health", timeout=1).ok, 900, what=f"vLLM {n}")
        print(f"2 vLLM CPU replicas Ready in {time.monotonic() - started:.0f} s", flush=True)
        self.stop_scrape = threading.Event()
        self.scraper = threading.Thread(target=self._scrape, name="bench-scrape", daemon=True)
        self.scraper.start()

    def publish(self, kv_events: bool, tag: str) -> None:
        from llmgw.state.records import EndpointInfo

        eps = [EndpointInfo(id=n, url=self.urls[n], models=("m",), engine="vllm", model="m", served_name="m",
                            capacity=8, **({"kv_events": f"tcp://127.0.0.1:{self.kv[n][0]}",
                                            "kv_replay": f"tcp://127.0.0.1:{self.kv[n][1]}",
                                            "tokenizer": self.model_dir} if kv_events else {}))
               for n in self.names]
        self.cluster.store().write_endpoints(eps, f"bench-real-{tag}", time.time())

    def reset(self) -> None:
        import requests

        for u in self.urls.values():
            requests.post(u + "/reset_prefix_cache", timeout=30).raise_for_status()

    def _scrape(self) -> None:
        from llmgw.state.clock import Clock
        from workers.agent.probe import HttpProber
        from workers.agent.scrape import Scraper, ScrapeTarget

        targets = [ScrapeTarget(n, u + "/metrics", "vllm", None) for n, u in self.urls.items()]
        cfg = __import__("types").SimpleNamespace(scrape_interval=1.0, scrape_timeout=1.0)
        Scraper(self.cluster.store(), HttpProber(), lambda: targets, cfg, Clock()).run(self.stop_scrape)

    def finished(self) -> dict[str, float]:
        """Each engine's finished requests (vllm:request_success_total over its reasons)."""
        import requests

        return {n: sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$",
                                                    requests.get(u + "/metrics", timeout=5).text, re.M))
                for n, u in self.urls.items()}

    def stop(self) -> None:
        self.stop_scrape.set()
        self.scraper.join(5)
        for n in self.names:
            self.cluster.procs.get(f"engine-{n}").stop()


def run_real_router(kind: str, cluster: Cluster, rf: RealVllmFleet, convs: list[Conversation], workdir: Path) -> Row:
    rf.reset()
    rf.publish(kv_events=kind == "llmgw-kv", tag=kind)
    router = Smg(cluster, rf) if kind == "smg" else Router("llmgw" if kind.startswith("llmgw") else kind, cluster,
                                                           rf, workdir, None)
    try:
        before, done = counters(rf.urls), rf.finished()
        results = run_traffic(router.url, convs)
        after, done_after = counters(rf.urls), rf.finished()
        hits = sum(after[n][0] - before[n][0] for n in after)
        queries = sum(after[n][1] - before[n][1] for n in after)
        shares = {n: int(done_after[n] - done[n]) for n in rf.names}
        return Row(kind, [replace(r, moved=None) for r in results], shares, hits / queries if queries else 0.0)
    finally:
        router.stop()


# --- one router, and the table ----------------------------------------------------------------------
@dataclass
class Row:
    router: str
    results: list[Result]
    shares: dict[str, int]
    hit_ratio: float

    def line(self) -> str:
        ok = [r for r in self.results if r.status == 200]
        ttft, lat = [r.ttft for r in ok if r.ttft is not None], [r.latency for r in ok]
        share = "/".join(str(v) for v in self.shares.values())
        return (f"  {self.router:11} {pct(ttft, .5):7.3f} {pct(ttft, .9):7.3f} {pct(ttft, .99):7.3f} "
                f"{pct(lat, .5):7.2f} {pct(lat, .99):7.2f} {len(self.results) - len(ok):5}/{len(self.results):<5} "
                f"{100 * self.hit_ratio:5.1f}%  {share}  {self.moved()}{self.expected()}")

    def moved(self) -> str:
        """How many later turns went to another engine than their conversation's previous turn."""
        later = [r.moved for r in self.results if r.moved is not None]
        return f"moved {sum(later)}/{len(later)}"

    def expected(self) -> str:
        """llmgw's own prediction (its answers' X-LLMGW-Prefix), beside the engines' measured hits."""
        got = [r.predicted for r in self.results if r.predicted is not None]
        total = sum(p for _, p in got)
        return f"  (expected {100 * sum(m for m, _ in got) / total:.1f}%)" if total else ""


def run_router(kind: str, cluster: Cluster, fleet: Fleet, convs: list[Conversation], workdir: Path) -> Row:
    # llmgw-kv: llmgw in precise mode, the engines publishing vLLM's KV events (docs/gateway.md).
    rf = RunningFleet(cluster, fleet, f"prefix-{kind}", kv_events=kind == "llmgw-kv")
    router = None
    try:
        if kind == "smg":
            router = Smg(cluster, rf)
        elif kind == "llmgw-2gw":
            router = TwoGateways(cluster, rf, workdir)
        else:
            router = Router("llmgw" if kind == "llmgw-kv" else kind, cluster, rf, workdir, None)
        before = counters(rf.urls)
        results = run_traffic(router.url, convs)
        after = counters(rf.urls)
        hits = sum(after[n][0] - before[n][0] for n in after)
        queries = sum(after[n][1] - before[n][1] for n in after)
        if not queries:  # llama.cpp's personality: no prefix-cache counters, its answers' timings say it
            hits, queries = (sum(r.reused[i] for r in results if r.reused is not None) for i in (0, 1))
        shares = {n: 0 for n in rf.names}
        for r in results:
            if r.status == 200:
                n = rf.engine_of(r.server)
                shares[n] = shares.get(n, 0) + 1
        return Row(kind, results, shares, hits / queries if queries else 0.0)
    finally:
        if router is not None:
            router.stop()
        rf.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"subset of {', '.join(ROUTERS)}")
    ap.add_argument("--conversations", type=int, default=None, help="default 80, --quick 8")
    ap.add_argument("--rate", type=float, default=2.0, help="conversations started per second")
    ap.add_argument("--mix", type=float, default=0.2, help="share of one-shot requests, 0 to below 1")
    ap.add_argument("--uneven", action="store_true", help="engine speeds 2, 1, 1, 0.5 instead of four equal ones")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--make", choices=("vllm", "llamacpp"), default="vllm",
                    help="the engines' personality: vLLM's prefix cache, or llama.cpp's slots that keep one prompt "
                         "each (and its /metrics names, which the agent's scraper maps as for a llama.cpp profile)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 8 conversations")
    ap.add_argument("--dump", type=Path, default=None,
                    help="write every request's figures (router, turn, one-shot, prompt bytes, ttft, latency, engine, "
                         "llmgw's predicted match and X-LLMGW-Prefix note) to this file, one JSON object a line, "
                         "to study a tail")
    ap.add_argument("--real-vllm", action="store_true",
                    help="2 real vLLM CPU replicas (make vllm) instead of 4 simulated engines; routers "
                         f"{', '.join(REAL_ROUTERS)}; 16 conversations at 0.25/s unless told")
    a = ap.parse_args(argv)
    if a.real_vllm:
        return main_real(a)
    unknown = [r for r in a.routers.split(",") if r not in ROUTERS]
    if unknown:
        ap.error(f"unknown router(s) {', '.join(unknown)}; choose from {', '.join(ROUTERS)}")
    if not 0 <= a.mix < 1 or a.rate <= 0:
        ap.error("--mix must be in [0, 1) and --rate positive")
    n = a.conversations or (8 if a.quick else 80)
    routers = a.routers.split(",")
    missing = {"nginx": nginx_binary() is None, "vllm-cache": not shutil.which(bin_path("vllm-router")),
               "smg": smg_binary() is None}
    for r in [r for r in routers if missing.get(r)]:
        print(f"{r} not found (nginx: apt-get install nginx; the others: pip install -e '.[bench]'): left out")
        routers.remove(r)
    # The engines' make (bench.routing starts them with its flags, and its scraper maps its /metrics).
    fleet = Fleet("prefix-uneven" if a.uneven else "prefix", prefix_engines(a.uneven), make=a.make)
    convs = workload(n, a.rate, a.mix, a.seed)
    requests_n = sum(c.turns for c in convs)
    print(f"{n} conversations + {sum(c.one_shot for c in convs)} one-shot requests ({requests_n} requests), "
          f"{len(fleet.engines)} {a.make} engines, speeds {[e.sim.speed for e in fleet.engines]}")
    print(f"  {'router':11} {'ttft50':>7} {'ttft90':>7} {'ttft99':>7} {'e2e50':>7} {'e2e99':>7} {'err/n':>11} "
          f"{'hits':>6}  served ({'/'.join(e.name for e in fleet.engines)})  moved (later turns)", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-prefix-"))
    cluster = Cluster(workdir)
    started = time.monotonic()
    try:
        cluster.start_redis()
        for kind in routers:
            row = run_router(kind, cluster, fleet, convs, workdir)
            print(row.line(), flush=True)
            if a.dump:
                with a.dump.open("a") as f:
                    t0 = min((r.started for r in row.results), default=0.0)
                    for r in row.results:
                        f.write(json.dumps({"router": kind, "turn": r.turn, "one_shot": r.one_shot,
                                            "prompt_bytes": r.prompt_bytes, "status": r.status, "ttft": r.ttft,
                                            "latency": r.latency, "engine": r.server, "moved": r.moved,
                                            "predicted": r.predicted, "note": r.note,
                                            "sent_at": round(r.started - t0, 4)}) + "\n")
        least = floor(convs, max((e.sim for e in fleet.engines), key=lambda c: c.speed))
        print(f"  {'no queue':11} {pct(least, .5):7.3f} {pct(least, .9):7.3f} {pct(least, .99):7.3f}   "
              "(the floor: each request's unavoidable prefill on an idle engine, see `floor`)")
        print(f"\n{len(routers)} routers in {time.monotonic() - started:.0f} s")
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def main_real(a: argparse.Namespace) -> int:
    routers = a.routers.split(",") if a.routers != ",".join(ROUTERS) else list(REAL_ROUTERS)
    unknown = [r for r in routers if r not in REAL_ROUTERS]
    if unknown:
        raise SystemExit(f"--real-vllm: unknown router(s) {', '.join(unknown)}; choose from {', '.join(REAL_ROUTERS)}")
    if "smg" in routers and smg_binary() is None:
        print("smg not found (pip install -e '.[bench]'): left out")
        routers.remove("smg")
    rate = a.rate if a.rate != 2.0 else 0.25
    n = a.conversations or (4 if a.quick else 16)
    convs = workload(n, rate, a.mix, a.seed)
    print(f"{n} conversations + {sum(c.one_shot for c in convs)} one-shot requests ({sum(c.turns for c in convs)} "
          f"requests) at {rate:g}/s, on 2 real vLLM CPU replicas (SmolLM2-135M, one core each)")
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-prefix-vllm-"))
    cluster = Cluster(workdir)
    started = time.monotonic()
    rf = None
    try:
        cluster.start_redis()
        rf = RealVllmFleet(cluster)
        print(f"  {'router':11} {'ttft50':>7} {'ttft90':>7} {'ttft99':>7} {'e2e50':>7} {'e2e99':>7} {'err/n':>11} "
              f"{'hits':>6}  served ({'/'.join(rf.names)})", flush=True)
        for kind in routers:
            row = run_real_router(kind, cluster, rf, convs, workdir)
            print(row.line().replace("  moved 0/0", ""), flush=True)
        print(f"\n{len(routers)} routers in {time.monotonic() - started:.0f} s")
    finally:
        if rf is not None:
            rf.stop()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
