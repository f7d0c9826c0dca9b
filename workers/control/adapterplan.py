"""The adapter step of a reconcile pass, decided: `decide_adapters(catalog, snap, actions, demand, now)`.
Pure: no Redis, no clock.

Runs after `plan`, over the same snapshot and the actions it returned. Per model with adapters, it
turns the replicas of the profiles with `lora:` into what `place_adapters` reads (held, loading,
told to hold, Ready, failed loads and their backoff) and the replicas the plan is about to create
(chosen for free: `fresh`), and returns what to write: each runtime replica's new `adapters_wanted`
(its agent loads and unloads to match), the adapters each new replica is created with, the
llama.cpp replicas to replace with another set (rolled like a spec change), and one row per adapter
for status and events. Replicas on their way out (asked to stop, Lost, rolled for a spec change or
for other adapters) are left out: what they hold keeps serving until they go, and the placement finds
every adapter a home among the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from llmgw.catalog import Catalog, Model, profile_spec_hash
from llmgw.catalog.types import ADAPTERS_AT_LAUNCH
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import CrashPolicy, State, derive
from workers.control.adapterplacement import (
    Backoff,
    LoadFailure,
    RelaunchWithAdapters,
    ReplicaSlots,
    place_adapters,
    slots_for,
    wants_for,
)
from workers.control.plan import Action, CreateReplica, DeleteRecord, StopReplica
from workers.control.snapshot import Snapshot


@dataclass(frozen=True)
class AdapterRow:
    """One adapter as this pass placed it: how many replicas it should be on at least (None: all that
    serve it), how many the placement gave it, why fewer (empty when not short), and its demand."""

    adapter: str
    model: str
    wanted: int | None
    placed: int
    reason: str = ""
    demand: float = 0.0

    @property
    def short(self) -> bool:
        return bool(self.reason)

    def to_dict(self) -> dict:
        return {"adapter": self.adapter, "model": self.model, "wanted": self.wanted, "placed": self.placed,
                "reason": self.reason, "demand": self.demand}

    @classmethod
    def from_dict(cls, d: dict) -> "AdapterRow":
        return cls(str(d["adapter"]), str(d["model"]), d.get("wanted"), int(d.get("placed") or 0),
                   str(d.get("reason") or ""), float(d.get("demand") or 0.0))


@dataclass(frozen=True)
class AdapterDecision:
    wanted: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # replica -> its new adapters_wanted
    created: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # new replica -> its adapters
    relaunch: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # llama.cpp replica -> its successor's
    rows: tuple[AdapterRow, ...] = ()
    nodes: Mapping[str, str] = field(default_factory=dict)  # replica -> its head node (whose agent to wake)

    def with_adapters(self, actions: Iterable[Action]) -> list[Action]:
        """The plan's actions with each new replica's adapters filled in."""
        return [replace(a, adapters=self.created[a.id]) if isinstance(a, CreateReplica) and a.id in self.created
                else a for a in actions]


def _failures(rec: ReplicaRecord) -> list[LoadFailure]:
    out = []
    for name, f in (rec.adapter_failures or {}).items():
        if isinstance(f, dict):
            out.append(LoadFailure(rec.id, name, str(f.get("reason") or ""), float(f.get("at") or 0.0),
                                   int(f.get("attempts") or 1)))
    return out


def _slots(model: Model, rec: ReplicaRecord, snap: Snapshot, now: float, policy: CrashPolicy) -> ReplicaSlots | None:
    """`rec` as placement reads it, or None when it is on its way out."""
    profile = model.profile(rec.profile)
    if profile is None or profile.lora is None or rec.stop_requested_at is not None:
        return None
    if rec.adapters_relaunch is not None or rec.spec_hash != profile_spec_hash(model, profile):
        return None  # being replaced: its successor is placed instead
    alive = all(n in snap.nodes for n in rec.all_nodes)
    st = derive(rec, alive, now, policy).state
    if st in (State.STOPPED, State.LOST, State.STOPPING, State.DRAINING):
        return None
    max_loras, serves, at_launch = slots_for(model, profile.name)
    if at_launch:  # the set it was launched (or will launch) with
        return ReplicaSlots(rec.id, rec.node or "", max_loras, serves, held=frozenset(rec.adapters_wanted),
                            ready=st is State.READY, at_launch=True)
    current = rec.adapters_attempt == rec.attempt
    return ReplicaSlots(rec.id, rec.node or "", max_loras, serves, held=frozenset(rec.holds),
                        loading=frozenset(rec.adapters_loading) if current else frozenset(),
                        ready=st is State.READY, assigned=frozenset(rec.adapters_wanted))


def decide_adapters(catalog: Catalog, snap: Snapshot, actions: Iterable[Action], demand: Mapping[str, float],
                    now: float, backoff: Backoff = Backoff(), policy: CrashPolicy = CrashPolicy()) -> AdapterDecision:
    """What this pass writes about adapters; `demand`: requests per adapter name, by the gateways."""
    actions = list(actions)
    leaving = {a.id for a in actions if isinstance(a, (StopReplica, DeleteRecord))}
    new = [a for a in actions if isinstance(a, CreateReplica)]
    by_model: dict[str, list[ReplicaRecord]] = {}
    for rec in snap.replicas:
        by_model.setdefault(rec.model, []).append(rec)
    wanted: dict[str, tuple[str, ...]] = {}
    created: dict[str, tuple[str, ...]] = {}
    relaunch: dict[str, tuple[str, ...]] = {}
    nodes: dict[str, str] = {}
    rows: list[AdapterRow] = []
    for model in catalog.models:
        # A model whose last adapter was removed still has replicas told to hold it: they are told
        # to hold none (seen on real vLLM: the removed adapter stayed loaded for good).
        if not any(p.lora is not None for p in model.profiles) or (
                not model.adapters and not any(r.adapters_wanted for r in by_model.get(model.name, []))):
            continue
        recs = {r.id: r for r in by_model.get(model.name, []) if r.id not in leaving}
        reps = [s for r in recs.values() if (s := _slots(model, r, snap, now, policy)) is not None]
        for a in new:
            if a.model != model.name:
                continue
            max_loras, serves, at_launch = slots_for(model, a.profile)
            if max_loras:
                reps.append(ReplicaSlots(a.id, a.placement.head if a.placement else "", max_loras, serves,
                                         ready=False, at_launch=at_launch, fresh=True))
        fresh = {s.replica_id for s in reps if s.fresh}
        failures = [f for s in reps if s.replica_id in recs for f in _failures(recs[s.replica_id])]
        names = {ad.name for ad in model.adapters}
        mine = {k: v for k, v in demand.items() if k in names}
        result = place_adapters(wants_for(model), reps, mine, failures, now, backoff)
        for s in reps:
            desired = tuple(sorted(result.desired[s.replica_id]))
            if s.replica_id in fresh:
                created[s.replica_id] = desired
            elif not s.at_launch and desired != tuple(recs[s.replica_id].adapters_wanted):
                wanted[s.replica_id] = desired
                nodes[s.replica_id] = s.node
        for act in result.actions:
            if isinstance(act, RelaunchWithAdapters):
                relaunch[act.replica_id] = act.adapters
        short = {x.adapter: x for x in result.shortfalls}
        for w in wants_for(model):
            x = short.get(w.name)
            rows.append(AdapterRow(w.name, model.name, w.replicas, len(result.holders(w.name)),
                                   x.reason if x else "", float(mine.get(w.name, 0.0))))
    return AdapterDecision(wanted, created, relaunch, tuple(rows), nodes)


def adapter_demand(reports: Iterable, hints: Mapping[str, object], names: Iterable[str], now: float,
                   idle_after: float = 300.0) -> dict[str, float]:
    """Requests per adapter as the gateways report them: in flight and queued (under the adapter's
    name), and a token amount for one asked for within `idle_after` seconds or held for by a gateway
    now (its demand hint): an adapter in use keeps a replica between requests."""
    names = set(names)
    out: dict[str, float] = {}
    for g in reports:
        for name, m in g.models.items():
            if name not in names:
                continue
            recent = m.last_request_at is not None and now - m.last_request_at <= idle_after
            out[name] = out.get(name, 0.0) + m.inflight + m.queued + (0.01 if recent else 0.0)
    for name in names & set(hints):
        out[name] = max(out.get(name, 0.0), 1.0)
    return {k: v for k, v in out.items() if v > 0}
