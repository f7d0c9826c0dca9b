"""Latency targets under load: how many requests get what they asked for (goodput) with llmgw reading
their targets, and with the same llmgw ignoring them, on the same traffic, in one run on the fleet
simulator (bench/fleetsim.py: seeded, a virtual clock, the gateway's real routing and admission in
bench/simshell.py's shell).

    python -m bench.slo [--fleets fleet-a,gpu-cpu] [--loads 0.7,0.9,1.1] [--tight 0.3] [--seconds 40]
                        [--modes on,off,least_inflight,power_of_two] [--seed 1]

Two classes of requests share the traffic (issue 60): `tight` (a first token within 300 ms, strict:
refused at once rather than served late) and `lax` (a first token within 5 s and the whole answer
within 60 s). The modes:

  on              llmgw with the targets (`X-LLMGW-TTFT` ...): routing to endpoints predicted to meet
                  them, a strict request that cannot be met refused at once with its predicted time,
                  the queue by due time once slack is short (gateway.routing.slo, ledger.Backlog)
  off             the same llmgw, the same requests, no targets sent (what llmgw did before them)
  least_inflight  nginx's least connections (llmgw's policy of that name), no targets
  power_of_two    vLLM's router, modelled (bench/fleetsim.py), no targets

Every mode is judged by the same targets (llmgw.slo.met): `goodput` is the share of a class's requests
(those arriving after the warm-up) answered within their targets; a refused request counts as missed.
`429-now` counts the requests refused on arrival as predicted to miss (each with its predicted first
byte and a Retry-After), `later` those refused after waiting (queue bounds, a target that could no
longer be met), `late` those answered but not within their targets. `ok/s` is the answers completed per
second while the traffic arrives (after the warm-up; all classes), and `x-off` that figure over llmgw's
without targets at the same load. Under each fleet's table: the predictor's error per engine (llmgw
with targets, every load: p50 and p90 of |predicted - actual| / actual of the time to first token from
the moment a request was sent), and one strict request's 429 as refused on arrival.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

from bench.fleets import FLEETS, HELD_OUT, Fleet, Load
from bench.fleetsim import Req, Result, Simulation
from bench.report import pct
from gateway.routing import slo
from llmgw.slo import Targets, met

TIGHT = Targets(ttft=0.3, strict=True)
LAX = Targets(ttft=5.0, deadline=60.0)
CLASSES = {"tight": TIGHT, "lax": LAX}
MODES = {"on": "llmgw", "off": "llmgw", "least_inflight": "least_inflight", "power_of_two": "power_of_two"}


class SloSim(Simulation):
    """bench/fleetsim.py's simulation with each request given a class (`tight` with probability
    `tight`), and its targets sent to the gateway when `sent` (else llmgw sees none)."""

    def __init__(self, fleet: Fleet, load: Load, policy: str, seed: int, tight: float, sent: bool):
        super().__init__(fleet, load, policy, seed)
        self.tight, self.sent = tight, sent
        self.asked: dict[int, Targets] = {}

    def _arrivals(self) -> list[Req]:
        reqs = super()._arrivals()
        rng = random.Random(self.seed * 104729 + 3)  # the same classes whatever the mode
        for r in reqs:
            t = self.asked[r.rid] = TIGHT if rng.random() < self.tight else LAX
            if self.sent:  # as gateway.http.admit reads them: from the request's arrival
                r.slo, r.due = slo.slo_of(t, 0.0, True), slo.due(r.arrival, t)
        return reqs


@dataclass
class Row:
    """One class of one mode's run at one load."""

    n: int
    goodput: float
    ttft50: float
    ttft99: float
    at_once: int  # refused on arrival, predicted to miss (429 with the predicted time)
    later: int  # refused after waiting
    late: int  # answered, not within its targets


def judge(result: Result, asked: dict[int, Targets], cls: str) -> Row:
    target = CLASSES[cls]
    reqs = [r for r in result.requests if asked[r.rid] is target]
    good = late = at_once = later = 0
    for r in reqs:
        if r.status == "ok":
            if met(target, r.first - r.arrival, None, r.done - r.arrival):
                good += 1
            else:
                late += 1
        elif (r.refusal is not None and r.refusal.shed == slo.SLO_MISS and r.done == r.arrival
              and r.attempt == 0):
            at_once += 1
        else:
            later += 1
    firsts = [r.first - r.arrival for r in reqs if r.status == "ok"]
    return Row(len(reqs), good / len(reqs) if reqs else float("nan"), pct(firsts, .5) if firsts else float("nan"),
               pct(firsts, .99) if firsts else float("nan"), at_once, later, late)


def throughput(result: Result, load: Load) -> float:
    """Answers completed per second while the traffic arrives, after the warm-up (a backlog left at
    the end, served after the arrivals stop, does not count)."""
    return sum(r.status == "ok" and load.warmup <= r.done < load.seconds for r in result.requests) / (
        load.seconds - load.warmup)


def predictor_error(results: list[Result]) -> dict[str, tuple[float, float, int]]:
    """Per engine: p50 and p90 of |predicted - actual| / actual of the first token, from the send."""
    errs: dict[str, list[float]] = {}
    for res in results:
        for r in res.ok():
            c = r.choice
            actual = r.first - r.sent
            if c is not None and c.predicted_ttft is not None and actual > 0:
                errs.setdefault(r.endpoint, []).append(abs(c.predicted_ttft - actual) / actual)
    return {e: (pct(xs, .5), pct(xs, .9), len(xs)) for e, xs in sorted(errs.items())}


def example_refusal(results: list[Result]) -> str:
    """One strict request's 429 message, as refused on arrival."""
    for res in results:
        for r in res.requests:
            if r.refusal is not None and r.refusal.shed == slo.SLO_MISS and r.done == r.arrival:
                return f"{r.refusal.error.reason} (Retry-After: {r.refusal.error.retry_after})"
    return ""


def run_fleet(fleet: Fleet, fractions: list[float], modes: list[str], tight: float, seconds: float,
              seed: int) -> None:
    """Runs every mode at every load on `fleet` and prints its table."""
    print(f"{fleet.name}: capacity {fleet.capacity():.1f} req/s{' (' + fleet.note + ')' if fleet.note else ''}; "
          f"tight {TIGHT.describe()} ({100 * tight:.0f} %), lax {LAX.describe()}")
    print(f"  {'load':5} {'mode':15} {'class':6} {'n':>5} {'goodput':>8} {'ttft50':>7} {'ttft99':>7} "
          f"{'429-now':>7} {'later':>6} {'late':>5} {'ok/s':>6} {'x-off':>6}")
    with_targets: list[Result] = []
    example = ""
    for f in fractions:
        load = Load(f"{100 * f:.0f}%", f, seconds=seconds)
        done: dict[str, tuple[float, dict[str, Row]]] = {}  # mode -> (answers per second, rows by class)
        for mode in modes:
            sim = SloSim(fleet, load, MODES[mode], seed, tight, sent=mode == "on")
            res = sim.run()
            rate = throughput(res, load)
            res = res.measured(load.warmup)
            if mode == "on":
                with_targets.append(res)
                example = example or example_refusal([res])
            done[mode] = (rate, {c: judge(res, sim.asked, c) for c in CLASSES})
        base = done["off"][0] if "off" in done else None
        for mode, (rate, by_class) in done.items():
            ratio = f"{rate / base:6.2f}" if base else f"{'':6}"
            for cls, row in by_class.items():
                print(f"  {load.name:5} {mode:15} {cls:6} {row.n:5} {100 * row.goodput:7.1f}% {row.ttft50:7.3f} "
                      f"{row.ttft99:7.3f} {row.at_once:7} {row.later:6} {row.late:5} {rate:6.2f} {ratio}",
                      flush=True)
    if with_targets:
        errs = predictor_error(with_targets)
        print("  predictor (on): first-token error p50/p90 per engine: "
              + ", ".join(f"{e} {100 * p50:.0f}%/{100 * p90:.0f}% (n {n})" for e, (p50, p90, n) in errs.items()))
    if example:
        print(f"  a strict request refused at once: {example}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleets", default="fleet-a,gpu-cpu", help="comma-separated names (bench/fleets.py)")
    ap.add_argument("--loads", default="0.7,0.9,1.1", help="fractions of each fleet's capacity")
    ap.add_argument("--modes", default=",".join(MODES), help=f"from {', '.join(MODES)}")
    ap.add_argument("--tight", type=float, default=0.3, help="share of the requests in the tight class")
    ap.add_argument("--seconds", type=float, default=40.0, help="each run's traffic (the first 5 s not counted)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    pool = {**FLEETS, **HELD_OUT}
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if a.seconds <= 5.0:
        ap.error("--seconds must be more than the 5 s warm-up")
    if not 0.0 <= a.tight <= 1.0:
        ap.error("--tight is a share, 0 to 1")
    for name in a.fleets.split(","):
        if name not in pool:
            ap.error(f"unknown fleet {name!r}; choose from {', '.join(pool)}")
        run_fleet(pool[name], [float(x) for x in a.loads.split(",")], modes, a.tight, a.seconds, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
