"""One reconcile pass, decided: `decide(catalog, snap, now) -> Reconcile`. Pure: no Redis, no clock.

The pass reads one `Snapshot` (`snapshot.load_snapshot`: one `Store.fleet_view` of the fleet, and of
the demand its catalog names, `demand_reads`) and decides in three phases over it:

1. **autoscaling** (`autoscale.decide_all`): each autoscaled profile's replica count, from the
   gateways' reports, the engines' loads, the cold-start hints and the samples and record the last
   passes wrote (docs/autoscaling.md);
2. **the plan** (`plan`): the replica actions, with those counts as the profiles' `replicas`;
3. **LoRA adapters** (`adapterplan.decide_adapters`): which replica holds which adapter, the adapters
   new replicas are created with, the llama.cpp replicas to replace with another set, a row per
   adapter and an event when one becomes short of replicas or whole again.

`Reconcile` is everything the apply shell (`apply.apply_reconcile`) writes, in its order, and when to
look again (controller-runtime's `RequeueAfter`). Applying it to the snapshot and deciding again at
the same time decides nothing (tests/unit/test_reconcile_properties.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from llmgw.catalog import Catalog
from llmgw.state.views import AdapterRows, DemandReads
from workers.control.adapterplan import AdapterDecision, AdapterRow, adapter_demand, decide_adapters
from workers.control.autoscale import Sample, ScalePass, ScaleSpec, autoscaled, decide_all
from workers.control.plan import Action, PlanConfig, StopReplica, plan
from workers.control.snapshot import Snapshot


@dataclass(frozen=True)
class PassEvent:
    """An event the pass adds to the history (`Store.emit`, source `control`); `data`: its extra
    fields. An action's own events (placed, draining, ...) are the apply's: they follow its write."""

    kind: str
    message: str
    model: str = ""
    profile: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scaling:
    """The autoscaling phase: each autoscaled profile's sample, decision and record (`scale`), how
    far back each profile's samples are kept, the records of profiles that no longer autoscale (to
    delete), and an event per change."""

    scale: ScalePass = ScalePass()
    keep_since: Mapping[tuple[str, str], float] = field(default_factory=dict)
    forget: tuple[tuple[str, str], ...] = ()
    events: tuple[PassEvent, ...] = ()

    @property
    def writes(self) -> bool:
        """Anything to write: an autoscaled profile's record and sample, or a record to delete."""
        return bool(self.scale.profiles or self.forget)


@dataclass(frozen=True)
class AdapterChanges:
    """The LoRA adapter phase: `decision` (None: the catalog names no adapter), the rows to write
    (None: leave what is stored; (): delete it) and an event per adapter that became short or whole."""

    decision: AdapterDecision | None = None
    rows: tuple[AdapterRow, ...] | None = None
    events: tuple[PassEvent, ...] = ()


@dataclass(frozen=True)
class Reconcile:
    """What one pass writes, in the apply's order: the autoscaler's records and events, the replica
    actions (each recorded before it is dispatched), the adapter changes, then the kicks."""

    scaling: Scaling
    actions: tuple[Action, ...]
    adapters: AdapterChanges
    # Look again in this many seconds (a load above target whose `scale_up_after` runs out then),
    # not at the timer: controller-runtime's RequeueAfter.
    requeue_after: float | None = None

    @property
    def requeue(self) -> bool:
        """Look again at once: replicas were marked to relaunch with another adapter set, which the
        next pass rolls."""
        return bool(self.adapters.decision and self.adapters.decision.relaunch)

    @property
    def kicks_publish(self) -> bool:
        """What is routable changes: a replica asked to stop, or an adapter no longer wanted on a
        replica (both are unpublished at once)."""
        return any(isinstance(a, StopReplica) for a in self.actions) or bool(
            self.adapters.decision and self.adapters.decision.wanted)

    @property
    def events(self) -> tuple[PassEvent, ...]:
        return self.scaling.events + self.adapters.events

    @property
    def settled(self) -> bool:
        """Decides nothing: no action, no count changed, no adapter moved or marked, no event (the
        autoscaler's sample and record are written every pass all the same)."""
        d = self.adapters.decision
        return (not self.actions and not self.events and not self.scaling.forget
                and not any(p.decision.changed for p in self.scaling.scale.profiles)
                and not (d is not None and (d.wanted or d.relaunch)))


def _adapter_names(catalog: Catalog) -> list[str]:
    return [a.name for m in catalog.models for a in m.adapters]


def _keep_since(catalog: Catalog, now: float) -> dict[tuple[str, str], float]:
    """Each autoscaled profile: the samples its decision reads are those from this time on."""
    return {(m.name, p.name): now - ScaleSpec.of(p).horizon for m, p in catalog.profiles() if p.autoscale is not None}


def demand_reads(catalog: Catalog, now: float) -> DemandReads:
    """What the pass reads besides the fleet (`load_snapshot`): the samples of autoscaled profiles
    within their horizon and their replicas' loads, the cold-start hints of their models and of
    the LoRA adapters, and the gateways' reports when either exists."""
    profiles = autoscaled(catalog)
    adapters = _adapter_names(catalog)
    hints = sorted({m for m, _ in profiles} | set(adapters))
    return DemandReads(histories=_keep_since(catalog, now), loads=frozenset(profiles), hints=tuple(hints),
                       gateways=bool(profiles or adapters))


def scale(catalog: Catalog, snap: Snapshot, now: float) -> Scaling:
    """The autoscaling phase over the snapshot's demand (`autoscale.decide_all`)."""
    d = snap.demand
    profiles = autoscaled(catalog)
    keep = set(profiles)
    forget = tuple(key for key in d.scale_states if key not in keep)
    if not profiles:
        return Scaling(forget=forget)
    keep_since = _keep_since(catalog, now)
    histories = {key: [s for s in map(Sample.from_list, rows) if s.t >= keep_since.get(key, s.t)]
                 for key, rows in d.histories.items()}
    result = decide_all(catalog, snap.replicas, d.scale_states, histories, d.gateways, d.loads, d.hints, now)
    events: list[PassEvent] = []
    for p in result.profiles:
        c = p.decision
        if not c.changed:
            continue
        events.append(PassEvent("replica_scaled", c.reason, p.model, p.profile,
                                {"before": c.current, "after": c.count}))
        if c.current == 0 and c.count > 0:
            events.append(PassEvent("model_cold_start", c.reason, p.model, p.profile, {"replicas": c.count}))
    return Scaling(result, keep_since, forget, tuple(events))


def adapter_changes(catalog: Catalog, snap: Snapshot, actions: list[Action], now: float) -> AdapterChanges:
    """The LoRA adapter phase over the snapshot and the plan's actions (`adapterplan.decide_adapters`)."""
    names = _adapter_names(catalog)
    before = snap.demand.adapter_rows
    if not names and not any(r.adapters_wanted for r in snap.replicas):
        # The catalog has no adapters (any more): their rows go. Replicas still told to hold a removed
        # adapter are first told to hold none (seen on real vLLM: it stayed loaded for good).
        return AdapterChanges(None, () if before.at is not None else None)
    d = snap.demand
    demand = adapter_demand(d.gateways, d.hints, names, now)
    decision = decide_adapters(catalog, snap, actions, demand, now)
    return AdapterChanges(decision, decision.rows, row_events(before, decision.rows))


def row_events(before: AdapterRows, rows: tuple[AdapterRow, ...]) -> tuple[PassEvent, ...]:
    """`adapter_short` when an adapter becomes short of replicas (or short for another reason),
    `adapter_placed` when a short one is whole again; an unreadable stored row counts as absent."""
    old: dict[tuple[str, str], AdapterRow] = {}
    for doc in before.rows:
        try:
            row = AdapterRow.from_dict(doc)
            old[(row.model, row.adapter)] = row
        except (KeyError, TypeError, ValueError):
            continue
    out = []
    for row in rows:
        prev = old.get((row.model, row.adapter))
        if row.short and (prev is None or prev.reason != row.reason):
            out.append(PassEvent("adapter_short", f"adapter {row.adapter} is on {row.placed} of "
                                 f"{row.wanted or 'all'} replicas: {row.reason}", row.model,
                                 data={"adapter": row.adapter}))
        elif not row.short and prev is not None and prev.short:
            out.append(PassEvent("adapter_placed", f"adapter {row.adapter} is placed on {row.placed} replicas again",
                                 row.model, data={"adapter": row.adapter}))
    return tuple(out)


def decide(catalog: Catalog, snap: Snapshot, now: float, config: PlanConfig = PlanConfig(),
           new_id: Callable[[str, str], str] | None = None) -> Reconcile:
    """The whole pass over one snapshot. Same inputs, same decision."""
    scaling = scale(catalog, snap, now)
    if scaling.scale.profiles:  # the planner runs autoscaled profiles at the counts just decided
        snap = replace(snap, wanted=scaling.scale.counts, replica_load=scaling.scale.replica_load)
    actions = plan(catalog, snap, now, config, new_id)
    adapters = adapter_changes(catalog, snap, actions, now)
    if adapters.decision is not None:  # new replicas are created with their adapters
        actions = adapters.decision.with_adapters(actions)
    recheck = scaling.scale.recheck_at
    return Reconcile(scaling, tuple(actions), adapters, None if recheck is None else recheck - now)
