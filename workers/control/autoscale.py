"""Autoscaling: how many replicas an autoscaled profile wants now. Pure: no Redis, no clock.

Each reconcile pass `observe`s one `Sample` per autoscaled profile from the gateways' reports (their
requests in flight on the profile's replicas, the requests of its model they hold queued or waiting
for a cold start, their last answer from each replica), the engines' scrapes (running + waiting, a
second opinion: the larger counts) and a gateway's cold-start hint. `desired(spec, history, current,
now)` turns the samples into a `Decision(count, reason)`:

- load per replica = demand / (capacity x replicas), demand = max(gateway in flight, engine running +
  waiting) + queued;
- above `target` for `scale_up_after`: up to as many replicas as the sustained load needs at target;
- one replica fewer would still carry the load at or below `target` for `scale_down_after`: down by
  one (the band between the two thresholds is the hysteresis: a noisy signal inside it changes
  nothing, and a window restarts at every change);
- at zero, any request waiting starts replicas at once (a cold start); with `min: 0`, no work for
  `idle_after` takes the profile to zero;
- never outside [min, max].

`decide_all(...)` does that for every autoscaled profile of the catalog in one call and returns what
the reconcile shell writes (samples, states) and what the planner reads (counts, replica loads).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from llmgw.catalog import Catalog, Profile
from llmgw.state.demand_records import DemandHint, GatewayReport, ScaleState
from llmgw.state.records import LoadRecord, ReplicaRecord
from llmgw.state.replica_state import LOAD_FRESH_FOR

log = logging.getLogger("llmgw.control.autoscale")

# History kept beyond the longer window (seconds): a pass that runs late still finds the run's start.
HISTORY_SLACK = 30.0
# At most this many samples per profile (kicks can make passes more often than the timer).
HISTORY_MAX = 600
# A gateway's cold-start hint counts for this long (seconds) after it was written; its report, which
# carries the same queue, takes over well before.
HINT_FRESH_FOR = 10.0


@dataclass(frozen=True)
class ScaleSpec:
    """What `desired` needs of a profile: its autoscale block and the capacity of one replica."""

    min: int
    max: int
    target: float
    capacity: int
    scale_up_after: float
    scale_down_after: float
    idle_after: float | None = None

    @classmethod
    def of(cls, profile: Profile) -> "ScaleSpec":
        a = profile.autoscale
        assert a is not None, "only autoscaled profiles have a scale spec"
        return cls(a.min, a.max, a.target, profile.capacity or 1, a.scale_up_after, a.scale_down_after,
                   a.idle_after)

    @property
    def horizon(self) -> float:
        """How much history a decision reads (seconds)."""
        return max(self.scale_up_after, self.scale_down_after) + HISTORY_SLACK


@dataclass(frozen=True)
class Sample:
    """The profile's demand at `t`: requests in flight on its replicas as the gateways count them, the
    engines' own running + waiting (None: no fresh scrape), the requests of its model the gateways hold
    (queued, or waiting for a cold start), and the latest evidence of work (carried forward)."""

    t: float
    inflight: float = 0.0
    engine: float | None = None
    queued: float = 0.0
    last_active: float | None = None

    @property
    def demand(self) -> float:
        return max(self.inflight, self.engine or 0.0) + self.queued

    def to_list(self) -> list:
        return [self.t, self.inflight, self.engine, self.queued, self.last_active]

    @classmethod
    def from_list(cls, v: Sequence) -> "Sample":
        return cls(*v[:5])


@dataclass(frozen=True)
class Decision:
    count: int
    reason: str  # in words: "3 -> 4: load 0.92 per replica for 6 s, target 0.7"
    current: int = 0
    # The load is above target but not yet for `scale_up_after`: when it will have been, if it stays
    # (the reconcile shell asks for a pass then, instead of waiting for its timer).
    recheck_at: float | None = None

    @property
    def changed(self) -> bool:
        return self.count != self.current


def load_per_replica(demand: float, capacity: int, replicas: int) -> float:
    return demand / (capacity * replicas) if replicas > 0 else math.inf


def _needed(demand: float, spec: ScaleSpec) -> int:
    """Replicas that carry `demand` at `target` (the small epsilon keeps 2.0000001 from becoming 3)."""
    return max(1, math.ceil(demand / (spec.capacity * spec.target) - 1e-9))


def _secs(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s".replace(".0 s", " s")


def _run(samples: Sequence[Sample], holds, since: float | None) -> list[Sample]:
    """The newest samples for which `holds` is true, back to the first that is not (or to `since`:
    samples from before the last change were taken at another count)."""
    out: list[Sample] = []
    for s in reversed(samples):
        if (since is not None and s.t < since) or not holds(s):
            break
        out.append(s)
    out.reverse()
    return out


def _waiting(s: Sample) -> str:
    if s.queued:
        n = int(s.queued) if float(s.queued).is_integer() else s.queued
        return f"{n} request{'s' if n != 1 else ''} waiting"
    return f"{s.demand:g} in flight"


def desired(spec: ScaleSpec, history: Sequence[Sample], current: int, now: float,
            since: float | None = None) -> Decision:
    """The replica count the profile wants now, and why. `history`: samples, oldest first (the newest
    is this pass's); `current`: the count wanted so far, in effect since `since` (None: unknown)."""
    lo, hi = spec.min, spec.max
    if current < lo:
        return Decision(lo, f"{current} -> {lo}: min is {lo}", current)
    if current > hi:
        return Decision(hi, f"{current} -> {hi}: max is {hi}", current)
    samples = [s for s in history if s.t <= now]
    if not samples:
        return Decision(current, f"holds {current}: no load figures yet", current)
    latest = samples[-1]
    demand = latest.demand

    if current == 0:
        if demand > 0:
            n = min(hi, _needed(demand, spec))
            return Decision(n, f"0 -> {n}: {_waiting(latest)} (cold start)", current)
        return Decision(0, "holds 0: idle", current)

    if lo == 0 and spec.idle_after is not None and demand == 0:
        quiet_since = latest.last_active if latest.last_active is not None else since
        if quiet_since is not None and now - quiet_since >= spec.idle_after:
            return Decision(0, f"{current} -> 0: no request for {_secs(now - quiet_since)} "
                               f"(idle_after {_secs(spec.idle_after)})", current)

    cap, target = spec.capacity, spec.target
    up = _run(samples, lambda s: load_per_replica(s.demand, cap, current) > target, since)
    if up and current < hi and now - up[0].t >= spec.scale_up_after:
        level = min(s.demand for s in up)  # what the load has been at least, all along the run
        n = min(hi, max(current + 1, _needed(level, spec)))
        return Decision(n, f"{current} -> {n}: load {load_per_replica(level, cap, current):.2f} per replica "
                           f"for {_secs(now - up[0].t)}, target {target:g}", current)
    recheck = up[0].t + spec.scale_up_after if up and current < hi else None

    floor = max(lo, 1)  # only idleness takes a profile to zero
    if current > floor:
        fewer = current - 1
        down = _run(samples, lambda s: load_per_replica(s.demand, cap, fewer) <= target, since)
        if down and now - down[0].t >= spec.scale_down_after:
            peak = max(s.demand for s in down)
            return Decision(fewer, f"{current} -> {fewer}: load {load_per_replica(peak, cap, current):.2f} per "
                                   f"replica for {_secs(now - down[0].t)}; {fewer} carry it at "
                                   f"{load_per_replica(peak, cap, fewer):.2f}, target {target:g}", current)
    return Decision(current, f"holds {current}: load {load_per_replica(demand, cap, current):.2f} per replica, "
                             f"target {target:g}", current, recheck)


def observe(
    now: float,
    model_names: Iterable[str],
    replica_ids: Iterable[str],
    reports: Iterable[GatewayReport],
    loads: Mapping[str, LoadRecord],
    hint: DemandHint | None = None,
    last_active: float | None = None,
) -> Sample:
    """One sample of a profile's demand. `model_names`: its model's name and aliases (a gateway with
    no endpoint for a model reports it under the name it was asked by); `last_active`: the previous
    evidence of work, carried forward."""
    ids = set(replica_ids)
    names = set(model_names)
    inflight = queued = 0.0
    active = last_active
    for g in reports:
        for rid in ids:
            use = g.endpoints.get(rid)
            if use is not None:
                inflight += use.inflight
                if use.ok_at is not None:  # the last answer from one of the profile's replicas
                    active = use.ok_at if active is None else max(active, use.ok_at)
        queued += sum(d.queued for name, d in g.models.items() if name in names)
    if hint is not None and now - hint.at <= HINT_FRESH_FOR:
        queued = max(queued, float(hint.queued))
    engine = None
    for rid in ids:
        rec = loads.get(rid)
        if rec is not None and rec.ok and now - rec.ts <= LOAD_FRESH_FOR:
            engine = (engine or 0.0) + (rec.running or 0.0) + (rec.waiting or 0.0)
    sample = Sample(now, inflight, engine, queued, active)
    if sample.demand > 0:
        sample = Sample(now, inflight, engine, queued, now)
    return sample


@dataclass(frozen=True)
class ProfileScale:
    """One autoscaled profile's outcome of a pass."""

    model: str
    profile: str
    sample: Sample
    decision: Decision
    state: ScaleState
    horizon: float


@dataclass(frozen=True)
class ScalePass:
    profiles: tuple[ProfileScale, ...] = ()
    # Requests each replica holds (max of the gateways' count and its engine's): scale-down stops the
    # least loaded first.
    replica_load: Mapping[str, float] = field(default_factory=dict)

    @property
    def counts(self) -> dict[tuple[str, str], int]:
        return {(p.model, p.profile): p.decision.count for p in self.profiles}

    @property
    def recheck_at(self) -> float | None:
        """The earliest moment a pending scale-up window completes (None: nothing pending)."""
        return min((p.decision.recheck_at for p in self.profiles if p.decision.recheck_at is not None),
                   default=None)


def autoscaled(catalog: Catalog) -> list[tuple[str, str]]:
    return [(m.name, p.name) for m, p in catalog.profiles() if p.autoscale is not None]


def decide_all(
    catalog: Catalog,
    replicas: Iterable[ReplicaRecord],
    states: Mapping[tuple[str, str], ScaleState],
    histories: Mapping[tuple[str, str], Sequence[Sample]],
    reports: Sequence[GatewayReport],
    loads: Mapping[str, LoadRecord],
    hints: Mapping[str, DemandHint],
    now: float,
) -> ScalePass:
    """Observe and decide every autoscaled profile. A profile without a state starts from the replicas
    it has (not asked to stop), so switching a fixed profile to autoscale restarts nothing."""
    by_profile: dict[tuple[str, str], list[ReplicaRecord]] = {}
    for rec in replicas:  # draining ones too: the requests they finish are still the profile's work
        by_profile.setdefault((rec.model, rec.profile), []).append(rec)
    replica_load: dict[str, float] = {}
    out: list[ProfileScale] = []
    for m, p in catalog.profiles():
        if p.autoscale is None:
            continue
        key = (m.name, p.name)
        recs = by_profile.get(key, [])
        state = states.get(key)
        history = list(histories.get(key, ()))
        if state is None:
            carried: float | None = now  # the idle clock starts when autoscaling does
        else:
            known = [t for t in (state.last_active, history[-1].last_active if history else None) if t is not None]
            carried = max(known) if known else None
        sample = observe(now, m.names, [r.id for r in recs], reports, loads, hints.get(m.name), carried)
        history = [s for s in history if s.t < now] + [sample]
        spec = ScaleSpec.of(p)
        current = state.count if state is not None else sum(1 for r in recs if r.stop_requested_at is None)
        try:
            decision = desired(spec, history, current, now, state.since if state is not None else None)
        except Exception:  # one bad profile must not stop the pass: it holds its count
            log.exception("autoscaling %s/%s failed this pass; holding %d replicas", m.name, p.name, current)
            decision = Decision(current, f"holds {current}: autoscaling failed this pass (see the control log)",
                                current)
        if decision.changed or state is None:
            new_state = ScaleState(decision.count, now, decision.reason, current, now, sample.last_active,
                                   decision.reason)
        else:
            new_state = ScaleState(state.count, state.since, state.reason, state.previous, now,
                                   sample.last_active, decision.reason)
        out.append(ProfileScale(m.name, p.name, sample, decision, new_state, spec.horizon))
        for r in recs:
            replica_load[r.id] = _replica_load(r.id, reports, loads, now)
    return ScalePass(tuple(out), replica_load)


def _replica_load(rid: str, reports: Iterable[GatewayReport], loads: Mapping[str, LoadRecord], now: float) -> float:
    gw = sum(g.endpoints[rid].inflight for g in reports if rid in g.endpoints)
    rec = loads.get(rid)
    engine = ((rec.running or 0.0) + (rec.waiting or 0.0)
              if rec is not None and rec.ok and now - rec.ts <= LOAD_FRESH_FOR else 0.0)
    return max(float(gw), engine)
