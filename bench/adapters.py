"""Many LoRA adapters with skewed popularity on engines that batch at most `max_loras` distinct adapters:
llmgw's adapter-aware routing against routing that ignores adapters, same run, side by side.

    python -m bench.adapters [--quick] [--adapters 12] [--max-loras 4] [--engines 4] [--rate 24]
                             [--seconds 30] [--zipf 1.0] [--modes llmgw,llmgw-uniform,base-only] [--seed 1]

The fleet: simulated engines in vLLM's personality (`python -m simengine --enable-lora`: at most
`--max-loras` distinct adapters in a running batch, a request for another one waits, as in vLLM's
scheduler), each able to hold every adapter (`--max-cpu-loras`), in front of llmgw's gateway (as
bench/routing.py starts it: redis, the endpoint list, the agent's scraper). The traffic: open loop
(Poisson, `--rate` a second), streamed chat requests naming one of `--adapters` adapters drawn with
Zipf popularity (`--zipf`), short prompts, 16-64 tokens out. Modes, each on freshly started engines:
- `llmgw`: the reconciler's placement (`workers.control.adapterplacement.place_adapters`) with the
  adapters' popularity as demand, each engine loaded with its set, the gateway routing an adapter
  only to its holders (what llmgw does);
- `llmgw-uniform`: the same routing over a placement that knows no demand (each adapter on one
  replica, the rest spread evenly);
- `base-only`: routing that ignores adapters: every engine holds every adapter and takes any
  request by the base model (least loaded), so its batches mix all adapters and requests wait for
  an adapter slot (what a router without adapter affinity gets from vLLM).
Printed per mode: requests completed per second over the run, time to the first content token
p50/p90/p99, end to end p50/p99, errors. The default run takes about four minutes; `--quick` is a
smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench.report import pct
from bench.traffic import CLIENT_TIMEOUT, Result, chat
from llmgw.catalog import Profile, apply_catalog, parse_catalog
from llmgw.state.clock import Clock
from llmgw.state.records import EndpointInfo
from harness.cluster import Cluster
from harness.procs import bin_path, free_port, python, wait_until
from workers.agent.probe import HttpProber
from workers.agent.scrape import Scraper, ScrapeTarget
from workers.control.adapterplacement import AdapterWant, ReplicaSlots, place_adapters

MODES = ("llmgw", "llmgw-uniform", "base-only")
SIM = ["--max-seqs", "16", "--step-ms", "20", "--batch-alpha", "0.08", "--prefill-ms-per-token", "0.25"]


@dataclass(frozen=True)
class Setup:
    engines: int
    adapters: int
    max_loras: int
    rate: float
    seconds: float
    zipf: float
    seed: int

    @property
    def names(self) -> list[str]:
        return [f"ad{i:02d}" for i in range(self.adapters)]

    def popularity(self) -> dict[str, float]:
        weights = [1 / (i + 1) ** self.zipf for i in range(self.adapters)]
        total = sum(weights)
        return {n: w / total for n, w in zip(self.names, weights)}


def placement(s: Setup, demand: dict[str, float] | None) -> dict[str, list[str]]:
    """Each engine's adapters, as the reconcile pass would place them."""
    reps = [ReplicaSlots(f"e{i}", f"n{i}", s.max_loras, frozenset(s.names)) for i in range(s.engines)]
    plan = place_adapters([AdapterWant(n, 0 if demand else 1) for n in s.names], reps, demand)
    return {r: sorted(held) for r, held in plan.desired.items()}


def requests_for(s: Setup) -> list[tuple[float, str, int]]:
    """(start time, adapter, max_tokens) of every request: Poisson arrivals, Zipf adapters."""
    rng = random.Random(s.seed)
    pop = s.popularity()
    names, weights = list(pop), list(pop.values())
    out, t = [], 0.0
    while True:
        t += rng.expovariate(s.rate)
        if t >= s.seconds:
            return out
        out.append((t, rng.choices(names, weights)[0], rng.randint(16, 64)))


class Run:
    """The engines of one mode, published, with the agent's scraper, behind one llmgw gateway."""

    def __init__(self, cluster: Cluster, s: Setup, mode: str, workdir: Path):
        import requests

        self.cluster, self.mode = cluster, mode
        self.ports = [free_port() for _ in range(s.engines)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        for i, port in enumerate(self.ports):
            cluster.procs.start(f"engine-{mode}-{i}", [
                python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m", *SIM, "--seed", "1",
                "--enable-lora", "--max-loras", str(s.max_loras), "--max-cpu-loras", str(s.adapters)],
                env=cluster.env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="true"))
        for u in self.urls:
            wait_until(lambda u=u: requests.get(u + "/health", timeout=1).ok, 30, what=f"engine {u}")
        held = {"llmgw": placement(s, s.popularity()), "llmgw-uniform": placement(s, None)}.get(
            mode, {f"e{i}": s.names for i in range(s.engines)})
        for i, u in enumerate(self.urls):
            for name in held[f"e{i}"]:
                r = requests.post(u + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(workdir)},
                                  timeout=10)
                assert r.status_code == 200, r.text
        store = cluster.store()
        if mode == "base-only":
            # No adapter in the catalog, and the endpoints answer to every name: routed by the base model.
            apply_catalog(store, parse_catalog({"models": []}), source="bench", applied_by="bench")
            eps = [EndpointInfo(id=f"e{i}", url=u, models=("m", *s.names), engine="sim", capacity=16)
                   for i, u in enumerate(self.urls)]
        else:
            ads = [{"name": n, "source": str(workdir), "rank": 8, "replicas": 0} for n in s.names]
            apply_catalog(store, parse_catalog({"models": [{"name": "m", "profiles": [
                {"name": "p", "engine": "sim", "replicas": s.engines, "lora": {"max_loras": s.max_loras}}],
                "adapters": ads}]}), source="bench", applied_by="bench")
            eps = [EndpointInfo(id=f"e{i}", url=u, models=("m",), engine="sim", model="m", served_name="m",
                                profile="p", capacity=16, adapters=tuple(held[f"e{i}"]), adapter_slots=s.max_loras)
                   for i, u in enumerate(self.urls)]
        store.write_endpoints(eps, f"bench-adapters-{mode}", time.time())
        self.stop_scrape = threading.Event()
        self.scraper = threading.Thread(target=self._scrape, args=(s,), name="bench-scrape", daemon=True)
        self.scraper.start()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cluster.procs.start(f"gateway-{mode}", [bin_path("gunicorn"), "-c", "python:gateway.gunicorn_conf",
                                                "--log-level", "warning", "gateway:create_app()"],
                            env=cluster.env(LLMGW_GATEWAY_SEED="1", LLMGW_GATEWAY_BIND=f"127.0.0.1:{self.port}",
                                            LLMGW_GATEWAY_THREADS="1024", LLMGW_GATEWAY_QUEUE_TIMEOUT="60"),
                            cwd=str(ROOT))
        wait_until(lambda: requests.get(self.url + "/healthz", timeout=1).json()["endpoints"] == s.engines, 30,
                   what="the gateway")

    def _scrape(self, s: Setup) -> None:
        """The node agent's scraper (workers/agent/scrape.py), every second, as on a real node."""
        profile = Profile(name="p", engine="sim", lora={"max_loras": s.max_loras})
        targets = [ScrapeTarget(f"e{i}", u + "/metrics", "sim", profile) for i, u in enumerate(self.urls)]
        cfg = types.SimpleNamespace(scrape_interval=1.0, scrape_timeout=1.0)
        Scraper(self.cluster.store(), HttpProber(), lambda: targets, cfg, Clock()).run(self.stop_scrape)

    def stop(self) -> None:
        self.stop_scrape.set()
        self.scraper.join(5)
        for p in self.cluster.procs.procs:
            if p.name.endswith(f"-{self.mode}") or p.name.startswith(f"engine-{self.mode}-"):
                if p.alive():
                    p.stop()


def drive(url: str, plan: list[tuple[float, str, int]]) -> tuple[list[Result], float]:
    host, port = url.split("//", 1)[1].split(":")

    async def one(t0: float, at: float, adapter: str, max_tokens: int, out: list[Result]) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        body = {"model": adapter, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"a short question for {adapter}"}]}
        out.append(await chat(host, int(port), body, CLIENT_TIMEOUT))

    async def main() -> tuple[list[Result], float]:
        out: list[Result] = []
        t0 = time.monotonic()
        await asyncio.gather(*(one(t0, *p, out) for p in plan))
        return out, time.monotonic() - t0

    return asyncio.run(main())


def line(mode: str, results: list[Result], took: float) -> str:
    ok = [r for r in results if r.status == 200 and r.ttft is not None]
    ttft, lat = [r.ttft for r in ok], [r.latency for r in ok]
    return (f"  {mode:14} {len(ok) / took:6.2f} {pct(ttft, .5):7.3f} {pct(ttft, .9):7.3f} {pct(ttft, .99):7.3f} "
            f"{pct(lat, .5):7.2f} {pct(lat, .99):7.2f} {len(results) - len(ok):5}/{len(results)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {', '.join(MODES)}")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--adapters", type=int, default=12)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rate", type=float, default=None, help="requests per second (default 24, --quick 6)")
    ap.add_argument("--seconds", type=float, default=None, help="of traffic per mode (default 30, --quick 5)")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity skew: adapter i gets 1/(i+1)^zipf")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a smoke test: 5 s at 6 requests/s")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if a.adapters > a.engines * a.max_loras and "llmgw" in modes:
        ap.error(f"{a.adapters} adapters do not fit {a.engines} engines x {a.max_loras} slots: llmgw would hold "
                 "some nowhere (raise --max-loras or --engines)")
    s = Setup(a.engines, a.adapters, a.max_loras, a.rate or (6.0 if a.quick else 24.0),
              a.seconds or (5.0 if a.quick else 30.0), a.zipf, a.seed)
    plan = requests_for(s)
    top = sorted(s.popularity().items(), key=lambda kv: -kv[1])[:3]
    print(f"{len(plan)} requests over {s.seconds:g} s ({s.rate:g}/s) for {s.adapters} adapters (top: "
          + ", ".join(f"{n} {100 * p:.0f}%" for n, p in top) + f"), {s.engines} engines with max_loras "
          f"{s.max_loras}, 16 sequences each")
    print(f"  llmgw's placement: {placement(s, s.popularity())}")
    print(f"  {'mode':14} {'rps':>6} {'ttft50':>7} {'ttft90':>7} {'ttft99':>7} {'e2e50':>7} {'e2e99':>7} "
          f"{'err/n':>11}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-adapters-"))
    (workdir / "adapter_config.json").write_text(json.dumps({"r": 8}))
    cluster = Cluster(workdir)
    started = time.monotonic()
    try:
        cluster.start_redis()
        for mode in modes:
            run = Run(cluster, s, mode, workdir)
            try:
                results, took = drive(run.url, plan)
            finally:
                run.stop()
            print(line(mode, results, took), flush=True)
        print(f"\n{len(modes)} modes in {time.monotonic() - started:.0f} s")
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
