"""The Batch API on idle capacity: interactive traffic at 60 % of the fleet's capacity, with and without
a 5,000-line batch submitted at the same time, in one run.

    python -m bench.batch [--lines 5000] [--load 0.6] [--window 10] [--cycles 4] [--reserve 0.2]
                          [--alpha 0.02] [--engines 4] [--slots 16] [--seed 1]

The fleet: `--engines` simulated engines (`python -m simengine`, vLLM's personality: continuous batching
of `--slots` sequences, a decode step of 25 ms that grows by `--alpha` per extra sequence (0.02: a GPU's
memory-bound decode; bench/fleetsim.py's fleets use 0.1), 0.05 ms of prefill per prompt token),
published with `capacity` = their slots; their loads scraped every second by the agent's own scraper.
One gateway (gunicorn, its default workers), one batch worker (`celery -A workers worker -Q batch`)
and beat, on one Redis. Requests: 100-token prompts of random words (no prefix cache helps), 24
tokens out; interactive ones streamed, open loop, Poisson at `--load` of the fleet's capacity (the
requests per second it completes with every batch full, bench/fleetsim.py's `Fleet.capacity`).

The interactive traffic runs from start to end. The batch (`--lines` lines of the same shape, not
streamed) is uploaded and created with the `openai` client after a warm-up; for `--cycles` cycles
the batch worker is then stopped (SIGSTOP) for one `--window` and let run (SIGCONT) for the next, so
"without" and "with" the batch interleave under the same machine noise (this machine's other load
moves a whole-phase p99 by more than the batch does); then it runs to the end. A request counts in
the window it arrived in, unless it arrived in a window's first 2 s (the batch's lines ending, or
ramping up again). Printed: TTFT and latency p50/p99 without and with the batch, their ratio; the
batch's completion time (seconds it ran, the stopped windows left out); the share of idle capacity it
used in the windows it ran: the engines' generated tokens per second (`vllm:generation_tokens_total`)
beyond the rate of the windows without it, over the fleet's capacity in tokens per second beyond that
rate. `--reserve` sets LLMGW_BATCH_RESERVE (0: the batch may fill every slot, only admission's 429s
hold it back: sheddable requests alone). Starts everything itself on loopback and stops it all.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.fleets import Dist, Engine, Fleet, Load
from bench.fleetsim import Req, Result, Simulation
from bench.simshell import GatewayShell
from bench.report import pct
from bench.routing import RunningFleet, bodies
from simengine.core import SimConfig
from harness.cluster import Cluster
from harness.loadgen import StreamResult, open_loop_streams, poisson_times
from harness.procs import wait_until

CHAT = "/v1/chat/completions"
PROMPT, OUTPUT = 100, 24
_GEN = re.compile(r"^vllm:generation_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def fleet_of(engines: int, slots: int, alpha: float) -> Fleet:
    sim = SimConfig(max_seqs=slots, step_ms=25.0, batch_alpha=alpha, prefill_ms_per_token=0.05)
    return Fleet("batch", tuple(Engine(f"e{i}", sim, capacity=slots) for i in range(engines)),
                 prompt=Dist("const", PROMPT), output=Dist("const", OUTPUT))


def generated(rf: RunningFleet) -> float:
    """Tokens every engine generated since it started (their own /metrics)."""
    import requests

    total = 0.0
    for u in rf.urls.values():
        m = _GEN.search(requests.get(u + "/metrics", timeout=5).text)
        total += float(m.group(1)) if m else 0.0
    return total


def batch_file(n: int, seed: int) -> bytes:
    """`n` batch lines, the interactive requests' shape but not streamed."""
    out = []
    for i, raw in enumerate(bodies(fleet_of(1, 1, 0.0), n, seed + 1000)):
        body = json.loads(raw)
        body.pop("stream")
        out.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": body}))
    return ("\n".join(out) + "\n").encode()


SETTLE = 2.0  # seconds at the start of a window whose arrivals are not counted


@dataclass
class Window:
    running: bool  # the batch worker ran in it
    start: float  # seconds from the start of the interactive traffic
    end: float
    tokens: float = 0.0  # the engines generated in it


def shed_total(url: str) -> float:
    """Requests the gateway shed (429) for saturation: with no standard request ever queued here, the
    batch's lines."""
    import requests

    text = requests.get(url + "/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(r'^llmgw_gateway_shed_total\{[^}]*reason="saturated"[^}]*\} ([0-9.e+]+)$',
                                                      text, re.M))


def figures(results: list[StreamResult]) -> dict:
    ok = [r for r in results if r.status == 200]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    lat = [r.latency for r in ok]
    return {"ttft50": pct(ttft, .5), "ttft99": pct(ttft, .99), "lat50": pct(lat, .5), "lat99": pct(lat, .99),
            "errors": len(results) - len(ok), "n": len(results)}


def run(a) -> int:
    import signal
    import threading

    import openai

    fleet = fleet_of(a.engines, a.slots, a.alpha)
    cap = fleet.capacity()
    print(f"fleet: {a.engines} sim engines x {a.slots} slots, 25 ms steps +{a.alpha:g}/sequence, capacity "
          f"{cap:.1f} req/s ({cap * OUTPUT:.0f} tokens/s); interactive at {a.load:.0%}: {cap * a.load:.1f} req/s; "
          f"batch {a.lines} lines; {a.cycles} cycles of {a.window:g} s without and with it; "
          f"LLMGW_BATCH_RESERVE={a.reserve:g}", flush=True)
    warm = 10.0
    horizon = warm + 2 * a.cycles * a.window + a.lines / (cap * (1 - a.load) * 0.3) + 60  # the traffic's length
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-batch-") as tmp:
        # A stopped worker keeps its hold on the batch through a window (LLMGW_BATCH_LEASE_TTL).
        cluster = Cluster(Path(tmp), extra_env={"LLMGW_BATCH_RESERVE": str(a.reserve),
                                                "LLMGW_BATCH_LEASE_TTL": str(a.window * 3)})
        rf = None
        try:
            cluster.start_redis()
            rf = RunningFleet(cluster, fleet, "batch")
            url = cluster.start_gateway(graceful_timeout=5, LLMGW_GATEWAY_SEED="1", LLMGW_GATEWAY_WORKERS=str(a.workers))
            worker = cluster.start_batch_worker(LLMGW_BATCH_MAX_INFLIGHT=str(a.slots * a.engines))
            cluster.start_beat()
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=60)
            f = client.files.create(file=("bench.jsonl", io.BytesIO(batch_file(a.lines, a.seed))), purpose="batch")

            lw = Load("interactive", a.load, seconds=horizon)
            times = poisson_times(lw.rate_at(cap), lw.peak(cap), horizon, a.seed)
            stop = threading.Event()
            results: list[StreamResult] = []
            traffic = threading.Thread(target=lambda: results.extend(open_loop_streams(
                url, CHAT, bodies(fleet, len(times), a.seed), times, timeout=120, until=stop.is_set)), daemon=True)
            t0 = time.monotonic()  # the traffic's start, as open_loop_streams counts it (within a few ms)
            traffic.start()
            time.sleep(warm)  # the gateway learns the engines' speeds (unmeasured)
            worker.signal_group(signal.SIGSTOP)
            b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
            windows: list[Window] = []
            ran = 0.0
            for i in range(2 * a.cycles):
                running = i % 2 == 1
                worker.signal_group(signal.SIGCONT if running else signal.SIGSTOP)
                w = Window(running, time.monotonic() - t0, 0.0)
                g = generated(rf)
                time.sleep(a.window)
                w.tokens, w.end = generated(rf) - g, time.monotonic() - t0
                windows.append(w)
                ran += a.window if running else 0.0
            worker.signal_group(signal.SIGCONT)
            resumed = time.monotonic()

            def ended():
                got = client.batches.retrieve(b.id)
                return got if got.status in ("completed", "failed", "expired", "cancelled") else None

            final = wait_until(ended, horizon, interval=0.5, what="the batch to end")
            ran += time.monotonic() - resumed
            still = time.monotonic() - t0 < times[-1]
            stop.set()
            lines = client.files.content(final.output_file_id).text.splitlines() if final.output_file_id else []
            shed = shed_total(url)
            traffic.join(timeout=horizon)
        finally:
            if rf is not None:
                rf.stop()
            cluster.stop()
            if a.keep_logs:
                import shutil

                shutil.copytree(Path(tmp) / "logs", a.keep_logs, dirs_exist_ok=True)

    def arrivals(running: bool) -> list[StreamResult]:
        return [r for r in results for w in windows if w.running == running and w.start + SETTLE <= r.at < w.end]

    off, on = figures(arrivals(False)), figures(arrivals(True))
    print(f"\n{'interactive requests':28} {'TTFT p50':>9} {'p99':>7} {'latency p50':>12} {'p99':>7} {'errors':>7} "
          f"{'requests':>9}")
    for name, f_ in (("without the batch", off), ("with the batch", on)):
        print(f"{name:28} {f_['ttft50']:9.3f} {f_['ttft99']:7.3f} {f_['lat50']:12.3f} {f_['lat99']:7.3f} "
              f"{f_['errors']:7} {f_['n']:9}")
    print(f"with / without: TTFT p50 {on['ttft50'] / off['ttft50']:.2f}x, p99 {on['ttft99'] / off['ttft99']:.2f}x; "
          f"latency p50 {on['lat50'] / off['lat50']:.2f}x, p99 {on['lat99'] / off['lat99']:.2f}x")
    rate = {r: sum(w.tokens for w in windows if w.running == r) / sum(w.end - w.start for w in windows if w.running == r)
            for r in (False, True)}
    idle = cap * OUTPUT - rate[False]
    print(f"batch: {a.lines} lines, {final.status}: {final.request_counts.completed} answered, "
          f"{final.request_counts.failed} failed, {len(lines)} output lines; completed in {ran:.0f} s of running "
          f"({a.lines / ran:.1f} lines/s){'' if still else ' (the interactive traffic had ended before it)'}; "
          f"{shed:.0f} of its requests shed (429) by admission")
    print(f"idle capacity used while it ran: {(rate[True] - rate[False]) / idle:.0%} ({rate[True] - rate[False]:.0f} "
          f"of the {idle:.0f} tokens/s the interactive traffic left; {rate[False]:.0f} tokens/s interactive)")
    return 0


def upload(a) -> int:
    """`--upload N`: what storing a batch file of N lines costs: a gateway checks it line by line and
    writes it to Redis in chunks; then its content is read back."""
    import requests

    body = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": {
        "model": "m", "max_tokens": OUTPUT, "messages": [{"role": "user", "content": "word " * 80}]}}).encode() + b"\n"
        for i in range(a.upload))
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-batch-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.start_redis()
            url = cluster.start_gateway()
            t = time.monotonic()
            r = requests.post(url + "/v1/files", files={"file": ("big.jsonl", io.BytesIO(body))},
                              data={"purpose": "batch"}, timeout=600)
            up = time.monotonic() - t
            r.raise_for_status()
            t = time.monotonic()
            got = requests.get(url + f"/v1/files/{r.json()['id']}/content", timeout=600).content
            down = time.monotonic() - t
            mem = cluster.store().r.info("memory")["used_memory"]
        finally:
            cluster.stop()
    print(f"{len(body) / 1e6:.1f} MB, {a.upload} lines: uploaded and checked in {up:.2f} s, read back in {down:.2f} s "
          f"({'the same bytes' if got == body else 'DIFFERENT bytes'}); Redis used_memory {mem / 1e6:.1f} MB")
    return 0


# --- the same feeder in the simulator (bench/fleetsim.py): no processes, no noise ---------------------------
def simulate(a) -> int:
    """`--simulated`: bench/fleetsim.py's simulation of the same fleet and traffic (the real gateway's
    routing and admission on a virtual clock, the engines' batching model), with the batch worker's own
    decisions (`workers.batch.decide`: room, Throttle) feeding a batch through it as its gateway
    reports and the scrapes would tell it. Seeded and exact: the cost of the batch to interactive
    requests, without this machine's noise, for several reserves side by side."""
    from collections import deque

    from gateway.config import GatewaySettings
    from llmgw.state.demand_records import EndpointUse, GatewayReport, ModelDemand
    from workers.batch.decide import Throttle, learn_slots, room

    fleet = fleet_of(a.engines, a.slots, a.alpha)
    cap = fleet.capacity()
    warm, seconds = 10.0, a.sim_seconds
    start = warm

    class Feeder:
        def __init__(self, sim: "BatchSim", lines: int, reserve: float):
            self.sim, self.reserve = sim, reserve
            self.todo: deque[int] = deque(range(lines))
            self.inflight, self.done, self.shed, self.sent = 0, 0, 0, 0
            self.live: dict[int, Req] = {}  # its lines sent and not ended, by id
            self.throttle = Throttle(a.slots * a.engines)
            self.reports: list[GatewayReport] = []
            self.slots_seen: dict[str, int] = {}
            self.finished_at: float | None = None
            self.rng = __import__("random").Random(a.seed + 7)

        def begin(self) -> None:
            self.report()
            self.view()

        def report(self) -> None:  # every gateway's report, every LLMGW_GATEWAY_REPORT_INTERVAL
            now = self.sim.now
            self.reports = [GatewayReport(str(g.idx), now, endpoints={e: EndpointUse(n) for e, n in g.router.inflight.items()},
                                          models={"m": ModelDemand(0, len(g.queue))},
                                          feeders={"bench": self.holding(g.idx)}) for g in self.sim.gateways]
            if self.todo or self.inflight:
                self.sim.at(now + 0.5, "call", self.report)

        def view(self) -> None:  # every LLMGW_BATCH_VIEW_INTERVAL
            sim, now = self.sim, self.sim.now
            loads = dict(sim.store.records)
            self.slots_seen = learn_slots(self.slots_seen, loads)
            r = room("m", sim.store.eps, loads, self.reports, now, self.reserve, self.slots_seen, "bench")
            self.throttle.view(r, 1, self.inflight)
            self.fill()
            if self.todo or self.inflight:
                sim.at(now + 0.5, "call", self.view)

        def holding(self, gateway: int) -> int:
            """Its lines gateway `gateway` holds a slot for (the report's `feeders`: X-LLMGW-Feeder)."""
            return sum(1 for q in self.live.values() if q.gateway == gateway and q.choice is not None
                       and not getattr(q, "in_queue", False))

        def fill(self) -> None:
            while self.todo and self.throttle.may_send(self.inflight):
                k = self.todo.popleft()
                sim = self.sim
                req = Req(10_000_000 + self.sent, sim.now, fleet.prompt.sample(self.rng), fleet.output.sample(self.rng),
                          "sheddable", self.sent % len(sim.gateways))
                req.batch = k  # type: ignore[attr-defined]
                self.sent += 1
                self.inflight += 1
                self.live[req.rid] = req
                sim.pending += 1
                sim.gateways[req.gateway].admit(req)

        def ended(self, req: Req, status: str) -> None:
            sim = self.sim
            self.inflight -= 1
            self.live.pop(req.rid, None)
            if status == "ok":
                self.done += 1
                if not self.todo and not self.inflight:
                    self.finished_at = sim.now
            else:
                self.shed += status == "shed"
                self.throttle.shed(self.inflight)
                k = req.batch  # type: ignore[attr-defined]
                sim.at(sim.now + 1.0, "call", lambda: (self.todo.appendleft(k), self.fill()))
            sim.at(sim.now, "call", self.fill)  # after the gateway released it (the engine calls finish first)

    from gateway.routing.choice import Choice

    class PreemptingGateway(GatewayShell):
        """What this benchmark shows the gateway would need (not llmgw's code): a standard request
        that would wait for a slot takes one from the batch instead: the youngest sheddable request in
        flight is aborted at its engine (as closing its connection does) and its line sent again."""

        def admit(self, req: Req) -> None:
            if req.priority == "standard":
                res = self.router.route(self.request(req, len(self.queue) + 1))
                if isinstance(res, Choice):
                    self.router.release(res, None)
                elif res.kind == "saturated":
                    self._preempt()
            super().admit(req)

        def _preempt(self) -> None:
            sim = self.sim
            victims = [(r.sent, name, r) for name, e in sim.engines.items() for r in e.reqs.values()
                       if r.priority == "sheddable"]
            if not victims:
                return
            _, name, r = max(victims, key=lambda v: v[0])
            eng = sim.engines[name]
            eng.core.cancel(str(r.rid))
            del eng.reqs[str(r.rid)]
            sim.finish(r, "preempted")
            sim.gateways[r.gateway].release(r, ok=False)

    class BatchSim(Simulation):
        feeder: Feeder | None = None

        def finish(self, req: Req, status: str) -> None:
            was = req.status
            super().finish(req, status)
            if not was and self.feeder is not None and hasattr(req, "batch"):
                self.feeder.ended(req, status)

    def tokens(sim) -> float:
        return sum(e.core.generation_tokens_total for e in sim.engines.values())

    def one(seed: int, reserve: float | None, preempt: bool = False):
        load = Load("interactive", a.load, seconds=seconds, warmup=warm)
        sim = BatchSim(fleet, load, "llmgw", seed, GatewaySettings())
        if preempt:
            sim.gateways = [PreemptingGateway(sim, g.idx, g.router, g.pollers, g.exchange) for g in sim.gateways]
        marks: dict[str, float] = {}
        sim.at(start, "call", lambda: marks.__setitem__("start", tokens(sim)))
        sim.at(seconds, "call", lambda: marks.__setitem__("end", tokens(sim)))
        if reserve is not None:
            sim.feeder = Feeder(sim, a.lines, reserve)
            sim.at(start, "call", sim.feeder.begin)
        res = sim.run().measured(warm)
        return res, marks["end"] - marks["start"], sim.feeder

    reserves = [float(x) for x in a.reserves.split(",")]
    print(f"simulated: {a.engines} engines x {a.slots} slots, 25 ms steps +{a.alpha:g}/sequence, capacity {cap:.1f} req/s "
          f"({cap * OUTPUT:.0f} tokens/s); interactive at {a.load:.0%} for {seconds:g} s (from {warm:g} s measured), "
          f"a batch of {a.lines} lines from {start:g} s; seeds {a.seed}..{a.seed + a.seeds - 1}")
    print(f"\n{'reserve':>8} {'TTFT p50':>9} {'p99':>7} {'x p50':>6} {'x p99':>6} {'lat p99':>8} {'idle used':>10} "
          f"{'batch done':>11} {'shed':>6}")
    base = {}
    for seed in range(a.seed, a.seed + a.seeds):
        base[seed] = one(seed, None)
    def pooled(runs):
        out = Result(fleet.name, "x", "llmgw", 0)
        for r in runs:
            out.add(r)
        return out
    b_res = pooled(r for r, _, _ in base.values())
    b_tok = sum(t for _, t, _ in base.values())
    t50, t99 = b_res.pct("ttft", .5), b_res.pct("ttft", .99)
    print(f"{'none':>8}   {t50:7.3f} {t99:7.3f} {1:6.2f} {1:6.2f} {b_res.pct('lat', .99):8.3f} {'-':>10} {'-':>11} {'-':>6}")
    idle = cap * OUTPUT * (seconds - start) * a.seeds - b_tok
    rows = [(r, False) for r in reserves] + ([(r, True) for r in (0.0, 0.05)] if a.preempt else [])
    for reserve, preempt in rows:
        runs = [one(seed, reserve, preempt) for seed in range(a.seed, a.seed + a.seeds)]
        res = pooled(r for r, _, _ in runs)
        extra = sum(t for _, t, _ in runs) - b_tok
        done = sum(f.done for _, _, f in runs) / a.seeds
        shed = sum(f.shed for _, _, f in runs) / a.seeds
        p50, p99 = res.pct("ttft", .5), res.pct("ttft", .99)
        print(f"{reserve:8.2f}{'+P' if preempt else '  '} {p50:7.3f} {p99:7.3f} {p50 / t50:6.2f} {p99 / t99:6.2f} {res.pct('lat', .99):8.3f} "
              f"{extra / idle:10.0%} {done:11.0f} {shed:6.0f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=5000)
    ap.add_argument("--load", type=float, default=0.6, help="interactive load, a share of the fleet's capacity")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of each window without and with the batch")
    ap.add_argument("--cycles", type=int, default=4, help="windows without and with the batch, each")
    ap.add_argument("--reserve", type=float, default=0.2, help="LLMGW_BATCH_RESERVE (0: sheddable requests alone)")
    ap.add_argument("--alpha", type=float, default=0.02, help="the decode step's growth per extra running sequence")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="the gateway's gunicorn workers")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep-logs", metavar="DIR", help="copy every process's log there")
    ap.add_argument("--simulated", action="store_true", help="bench/fleetsim.py's simulation instead of processes")
    ap.add_argument("--reserves", default="0,0.05,0.1,0.2,0.3", help="--simulated: the reserves compared")
    ap.add_argument("--seeds", type=int, default=3, help="--simulated: seeds pooled per row")
    ap.add_argument("--preempt", action="store_true",
                    help="--simulated: also rows (+P) where the gateway would preempt the batch for a waiting request")
    ap.add_argument("--sim-seconds", type=float, default=120.0, help="--simulated: the interactive traffic's length")
    ap.add_argument("--upload", type=int, metavar="N", help="only store a file of N lines and read it back")
    a = ap.parse_args()
    return upload(a) if a.upload else simulate(a) if a.simulated else run(a)


if __name__ == "__main__":
    sys.exit(main())
