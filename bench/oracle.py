"""How far routing can go on bench/prefix.py's traffic: greedy routers that know the present exactly.

    python -m bench.oracle [--seeds 10] [--first-seed 1] [--policies oracle_own,oracle_total,llmgw,smg_cache_aware]
                           [--fleets prefix-bench] [--make vllm]

The issue's targets for that traffic ask llmgw for an end-to-end p99 at most 0.9x smg's, and a hit
ratio no lower than smg's. These routers say what routing alone can give there. Each runs in
bench/fleetsim.py's simulation of bench/prefix.py's default traffic and knows what no gateway can:

- every engine's exact state at the moment a request arrives: its queue, its running batch, its
  prefix cache block by block, the step in progress and when it ends;
- the request's exact answer length.

For each engine it simulates, with the engine's own model (simengine.core), what would happen there
if the request were sent now and nothing else arrived, and sends it where:

- `oracle_own`: the request itself completes soonest;
- `oracle_total`: the completion times of everyone on the engine grow least, the request's own
  included (its end-to-end time plus the delay it causes to the requests already there).

They do not know the future: the requests that arrive later and stall a batch with their prefill.
What they cannot remove from the end-to-end p99 is made by those arrivals, and no router that
knows only the present removes it either. The figures it prints, beside llmgw and the smg model on
the same seeds, are in docs/benchmarks.md. A seed takes 7-20 s per oracle on vLLM's cache and
20-40 s on llama.cpp's slots (whose prompts are copied whole).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import OrderedDict, deque
from dataclasses import replace

from bench import conversations as conv
from bench import fleetsim as fs
from bench.fleets import PREFIX_LOAD, prefix_fleets
from llmgw.state.records import EndpointInfo
from simengine.core import SimCore, _Seq
from simengine.prefix import PrefixCache, _Block

NEW = "oracle:new"  # the request being placed, in an engine's copy


def clone(core: SimCore) -> SimCore:
    """A copy of the engine's model that the simulation ahead may change freely: its queue, batch and
    cache are copied (a deepcopy took 95 % of the run), what no step changes is shared."""
    out = copy.copy(core)

    def seq(s: _Seq) -> _Seq:
        c = copy.copy(s)
        c.hashes = list(s.hashes)
        return c

    out.running = {k: seq(s) for k, s in core.running.items()}
    out.waiting = deque(seq(s) for s in core.waiting)
    if core.prefix is not None:
        p = core.prefix
        out.prefix = PrefixCache(p.block_size, {h: _Block(b.refs, b.parent) for h, b in p.blocks.items()},
                                 OrderedDict(p.free), [], p.queries, p.hits)
    if core.slots is not None:  # llama.cpp's slots (a slot's tokens grow in place): copied whole
        out.slots = copy.deepcopy(core.slots)
        for s in list(out.running.values()) + list(out.waiting):
            if s.slot is not None:
                s.slot = out.slots.slots[s.slot.id]
    return out


def ahead(engine, now: float, req: fs.Req | None, everyone: bool) -> tuple[dict[str, float], dict[str, float]]:
    """When each request on `engine` would get its first token and complete if `req` were sent now
    (None: not sent) and nothing else arrived: ({rid: first}, {rid: done}). Unless `everyone`, it stops
    once `req` is done."""
    core = clone(engine.core)
    if req is not None:
        core.submit(NEW, req.prompt, req.output, now, tokens=list(req.tokens), output=list(req.out_tokens))
    if engine.step is not None:
        step, end = engine.step  # the step in progress: what was just sent joins at its end
    else:
        step = core.plan_step(now)
        end = now + step.duration if step is not None else now
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while step is not None:
        for e in core.finish_step(step, end):
            if e.index == 0:
                first[e.rid] = end
            if e.done:
                done[e.rid] = end
        if req is not None and not everyone and NEW in done:
            break
        step = core.plan_step(end)
        if step is not None:
            end += step.duration
    return first, done


def oracle_own(gateway, req: fs.Req) -> EndpointInfo:
    """The engine where the request itself completes soonest."""
    now = gateway.sim.now
    return min(gateway.router.endpoints,
               key=lambda ep: ahead(gateway.sim.engines[ep.id], now, req, everyone=False)[1][NEW])


def oracle_total(gateway, req: fs.Req) -> EndpointInfo:
    """The engine where everyone's completion times grow least, the request's own included."""
    now = gateway.sim.now

    def cost(ep: EndpointInfo) -> float:
        engine = gateway.sim.engines[ep.id]
        _, without = ahead(engine, now, None, everyone=True)
        _, with_it = ahead(engine, now, req, everyone=True)
        return (with_it[NEW] - now) + sum(with_it[r] - t for r, t in without.items())

    return min(gateway.router.endpoints, key=cost)


def tail_of(result: fs.Result) -> tuple[float, float]:
    """What the slowest 1 % of a run's requests end to end are made of: their mean time to first
    token, and their mean time per answer token after it over the run's median time per token."""
    ok = sorted(result.ok(), key=lambda r: r.done - r.arrival)
    per_token = sorted((r.done - r.first) / (r.output - 1) for r in ok if r.output > 1)
    top = [r for r in ok[int(0.99 * len(ok)):] if r.output > 1]
    if not top or not per_token:
        return float("nan"), float("nan")
    median = per_token[len(per_token) // 2]
    return (sum(r.first - r.arrival for r in top) / len(top),
            sum((r.done - r.first) / (r.output - 1) for r in top) / len(top) / median)


ORACLES = {"oracle_own": oracle_own, "oracle_total": oracle_total}
fs.MODELLED.update({name: (lambda gw, pick=pick, name=name: fs.Picks(gw, pick, name))
                    for name, pick in ORACLES.items()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="oracle_own,oracle_total,llmgw,smg_cache_aware")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--fleets", default="prefix-bench", help="prefix-bench or prefix-uneven")
    ap.add_argument("--make", choices=conv.MAKES, default="vllm")
    a = ap.parse_args(argv)
    if a.seeds < 1:
        ap.error("--seeds must be at least 1")
    policies = a.policies.split(",")
    unknown = [p for p in policies if p not in ORACLES and p not in ("llmgw",) + fs.PEERS]
    if unknown:
        ap.error(f"unknown policy {unknown[0]!r}; choose from {', '.join(('llmgw',) + fs.PEERS + tuple(ORACLES))}")
    fleets = prefix_fleets()
    for fname in a.fleets.split(","):
        if fname not in fleets:
            ap.error(f"unknown fleet {fname!r}; choose from {', '.join(fleets)}")
        fleet = replace(fleets[fname], make=a.make)
        print(f"{fname}: bench/prefix.py's traffic on {a.make} engines, seeds {a.first_seed}-"
              f"{a.first_seed + a.seeds - 1} pooled")
        print(f"  {'load':6} {'policy':15} {'p50':>7} {'p90':>7} {'p99':>7} {'ttft50':>7} {'ttft99':>7} {'hits':>6}"
              f" {'held99':>7} {'err/n':>11} served")
        cell = {}
        for policy in policies:
            started, merged = time.monotonic(), None
            for seed in range(a.first_seed, a.first_seed + a.seeds):
                r = fs.run(fleet, PREFIX_LOAD, policy, seed, None, "prefix")
                if merged is None:
                    merged = r
                else:
                    merged.add(r)
            cell[policy] = merged
            print("\n".join(fs.table([merged], fleet, hits=True)) + f"   ({time.monotonic() - started:.0f} s)",
                  flush=True)
        print("  the slowest 1 % end to end: their mean first token, and their time per token against the run's median")
        for policy, r in cell.items():
            first, per_token = tail_of(r)
            print(f"    {policy:15} {first:6.3f} s  {per_token:4.2f}x")
        if "smg_cache_aware" in cell:
            smg = cell["smg_cache_aware"]
            print("  against the smg model: e2e p99, TTFT p99, hits (points)")
            for policy, r in cell.items():
                if policy != "smg_cache_aware":
                    print(f"    {policy:15} {r.pct('lat', .99) / smg.pct('lat', .99):5.2f}x "
                          f"{r.pct('ttft', .99) / smg.pct('ttft', .99):5.2f}x "
                          f"{100 * (r.hit_ratio() - smg.hit_ratio()):+5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
