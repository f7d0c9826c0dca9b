"""The reconcile pass's shell: under the reconcile lock, one read (`load_snapshot`), one decision
(`reconcile.decide`), and `apply_reconcile`, which writes what it returned to Redis and the node
queues. The other passes have shells of their own (`publish_pass.py`, `housekeeping_pass.py`,
`external.py`).

Every action records its intent in the replica record BEFORE the dispatch that acts on it, so a crash
in between leaves a record the next pass repairs (re-dispatching a stale launch or stop) instead of an
engine nobody knows about. Each action is applied on its own: one failure is logged and the rest go on.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from llmgw.state import keys
from llmgw.state.kicks import PUBLISH, RECONCILE, Kicker, disabled
from llmgw.state.store import Store
from workers.control.plan import (
    Action,
    CreateReplica,
    DeleteRecord,
    DispatchLaunch,
    DispatchStop,
    PlaceReplica,
    PlanConfig,
    StopReplica,
    UpdatePending,
)
from workers.control import reconcile
from workers.control.autoscale import HISTORY_MAX
from workers.control.gcpause import paused_gc
from workers.control.migrations import run_pending
from workers.control.reconcile import AdapterChanges, PassEvent, Reconcile, Scaling
from workers.control.snapshot import CatalogKeeper, load_snapshot

log = logging.getLogger("llmgw.control")
scale_log = logging.getLogger("llmgw.control.autoscale")
adapter_log = logging.getLogger("llmgw.control.adapters")


class Dispatcher(Protocol):
    """Tells a node's agent to look at a replica now (the agent is level-based: repeats are harmless)."""

    def launch(self, replica_id: str, node: str) -> None: ...

    def stop(self, replica_id: str, node: str) -> None: ...


class CeleryDispatcher:
    """Sends `llmgw.launch` / `llmgw.stop` to the node's own queue (`keys.node_queue`)."""

    def __init__(self, app):
        self.app = app

    def launch(self, replica_id: str, node: str) -> None:
        self.app.send_task("llmgw.launch", args=[replica_id], queue=keys.node_queue(node))

    def stop(self, replica_id: str, node: str) -> None:
        self.app.send_task("llmgw.stop", args=[replica_id], queue=keys.node_queue(node))


@dataclass
class ApplyResult:
    applied: int = 0
    failed: int = 0
    deferred: int = 0  # left for the next pass: the time budget ran out
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, action: Action) -> None:
        self.applied += 1
        name = type(action).__name__
        self.counts[name] = self.counts.get(name, 0) + 1


def apply_actions(
    actions: list[Action],
    store: Store,
    dispatcher: Dispatcher,
    now: float,
    out_of_time: Callable[[], bool] = lambda: False,
    trace: str | None = None,
) -> ApplyResult:
    """Apply each action; stop early when `out_of_time()` says so (the rest is planned again next
    pass from fresh facts, so deferring is safe, while overrunning the pass lock would not be).
    `trace`: the pass's traceparent, stored with the records it creates or places (their launch's
    parent, docs/tracing.md)."""
    result = ApplyResult()
    for i, action in enumerate(actions):
        if out_of_time():
            result.deferred = len(actions) - i
            log.warning("apply budget spent: %d actions deferred to the next pass", result.deferred)
            break
        try:
            _apply_one(action, store, dispatcher, now, trace)
            result.add(action)
        except Exception:  # one bad action must not stop the others
            result.failed += 1
            log.exception("failed to apply %r", action)
    return result


def _apply_one(action: Action, store: Store, dispatcher: Dispatcher, now: float, trace: str | None = None) -> None:
    if isinstance(action, CreateReplica):
        # The record first, with the engine's new credential ...
        rec = action.record(now, engine_secret=secrets.token_urlsafe(32))
        store.create_replica(dataclasses.replace(rec, traceparent=trace) if trace else rec)
        if action.placement is not None:
            where = ",".join(action.placement.nodes)
            log.info("launch %s (%s/%s) on %s: %s", action.id, action.model, action.profile, where, action.why)
            if action.moved_from:
                store.emit("replica_moved", f"{action.why}; now on {where} as {action.id}", source="control",
                           model=action.model, profile=action.profile, node=action.placement.head,
                           replica=action.moved_from, ts=now, new_replica=action.id)
            store.emit("replica_placed", f"placed on {where}: {action.why}", source="control",
                        model=action.model, profile=action.profile, node=action.placement.head,
                        replica=action.id, ts=now)
            for node in action.placement.nodes:  # ... then the dispatch
                dispatcher.launch(action.id, node)
        else:
            log.info("pending %s (%s/%s): %s", action.id, action.model, action.profile, action.pending_reason)
            store.emit("replica_pending", action.pending_reason or "", source="control",
                        model=action.model, profile=action.profile, replica=action.id, ts=now)
    elif isinstance(action, PlaceReplica):
        p = action.placement
        if store.update_replica(action.id, **action.fields(now), **({"traceparent": trace} if trace else {})):
            where = ",".join(p.nodes)
            log.info("launch %s on %s (was pending)", action.id, where)
            store.emit("replica_placed", f"placed on {where} (was Pending)", source="control",
                       model=action.model, profile=action.profile, node=p.head, replica=action.id, ts=now)
            for node in p.nodes:
                dispatcher.launch(action.id, node)
    elif isinstance(action, UpdatePending):
        store.update_replica(action.id, **action.fields())
    elif isinstance(action, StopReplica):
        if store.update_replica(action.id, stop_requested_at=now, stop_reason=action.reason,
                                drain_timeout=action.drain_timeout):
            log.info("stop %s: %s", action.id, action.reason)
            store.emit(action.event, action.reason, source="control", replica=action.id,
                        model=action.model,
                        node=action.nodes[0] if action.nodes else "", ts=now,
                        drain_timeout=action.drain_timeout)
            if action.dispatch:
                for node in action.nodes:
                    dispatcher.stop(action.id, node)
    elif isinstance(action, DeleteRecord):
        store.delete_replica(action.id)
        log.info("delete record %s: %s", action.id, action.reason)
    elif isinstance(action, DispatchLaunch):
        if store.update_replica(action.id, launch_dispatched_at=now):
            log.info("re-dispatch launch of %s to %s", action.id, ",".join(action.nodes))
            for node in action.nodes:
                dispatcher.launch(action.id, node)
    elif isinstance(action, DispatchStop):
        for node in action.nodes:
            dispatcher.stop(action.id, node)
    else:  # pragma: no cover - a new action type without an apply rule is a programming error
        raise TypeError(f"unknown action {action!r}")


# --- the passes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReconcilePass:
    """What one reconcile pass runs with: `reconcile_once`'s arguments, and when it began."""

    store: Store
    dispatcher: Dispatcher
    now: Callable[[], float]
    started: float  # on `monotonic`'s clock
    lock_ttl: float = 30.0
    config: PlanConfig = PlanConfig()
    catalog_sync: Callable[[], object] | None = None
    monotonic: Callable[[], float] = time.monotonic
    catalogs: CatalogKeeper = field(default_factory=CatalogKeeper)
    kicker: Kicker = field(default_factory=disabled)
    trace: str | None = None  # the pass's traceparent (llmgw.tracing), given to the records it makes

    def out_of_time(self) -> bool:
        """Applying stops at half the lock's TTL, so the pass never outlives its lock."""
        return self.monotonic() - self.started > self.lock_ttl / 2


def reconcile_once(
    store: Store,
    dispatcher: Dispatcher,
    now: Callable[[], float],
    lock_ttl: float = 30.0,
    config: PlanConfig = PlanConfig(),
    catalog_sync: Callable[[], object] | None = None,
    monotonic: Callable[[], float] = time.monotonic,
    catalogs: CatalogKeeper | None = None,
    kicker: Kicker | None = None,
    trace: str | None = None,
) -> ApplyResult | None:
    """One reconcile pass under the reconcile lock; None when another pass holds it (or no readable
    catalog was ever seen by `catalogs`, the process's CatalogKeeper). Applying stops at half the
    lock's TTL, so a huge pass (a cold start of thousands of replicas) never outlives its lock and
    overlaps the next one. A fact kicked while the pass ran makes it kick itself again (llmgw.kicks)."""
    p = ReconcilePass(store, dispatcher, now, monotonic(), lock_ttl, config, catalog_sync, monotonic,
                      catalogs or CatalogKeeper(), kicker or disabled(), trace)
    with store.lock(keys.RECONCILE_LOCK, lock_ttl) as held:
        if not held:
            log.info("reconcile skipped: another pass holds the lock")
            p.kicker.mark_dirty(RECONCILE)
            return None
        p.kicker.started(RECONCILE)
        result = None
        try:
            result = _reconcile(p)
            return result
        finally:
            p.kicker.finished(RECONCILE)
            store.count_pass("reconcile", monotonic() - p.started, result.applied if result else 0)


def _reconcile(p: ReconcilePass) -> ApplyResult | None:
    run_pending(p.store)
    if p.catalog_sync is not None:
        try:
            p.catalog_sync()
        except Exception:  # a bad catalog file must not stop the fleet being reconciled
            log.exception("catalog file sync failed; reconciling the applied catalog")
    loaded = p.catalogs.load(p.store)
    if loaded is None:
        return None
    catalog = loaded.catalog
    t = p.now()
    snap = load_snapshot(p.store, t, reconcile.demand_reads(catalog, t))
    # plan makes many small objects and no cycles: GC sweeps amid it are pure cost (`python -m bench.scheduler`)
    with paused_gc():
        decision = reconcile.decide(catalog, snap, t, p.config)
    result = apply_reconcile(decision, p, t)
    if result.applied or result.failed or result.deferred:
        log.info("reconcile: %s applied, %s failed, %s deferred %s", result.applied, result.failed,
                 result.deferred, result.counts)
    return result


def apply_reconcile(d: Reconcile, p: ReconcilePass, now: float) -> ApplyResult:
    """Write what one pass decided, in this order: the autoscaler's records and events (the counts
    the actions follow), the actions (each recorded, then dispatched, until the pass's time is
    spent), the LoRA adapters each replica holds, the replicas to relaunch with another set and
    the adapter rows; then the kicks the decision asks for."""
    _write_scaling(p.store, d.scaling, now)
    result = apply_actions(list(d.actions), p.store, p.dispatcher, now, p.out_of_time, p.trace)
    _write_adapters(p.store, d.adapters, now)
    if d.kicks_publish:
        p.kicker.kick(PUBLISH)  # a stop (or an adapter taken off a replica) unpublishes at once
    if d.requeue:
        p.kicker.kick(RECONCILE)  # the next pass rolls the replicas marked for another adapter set
    if d.requeue_after is not None:  # a load above target: decide when its window ends, not at the timer
        p.kicker.kick_in(RECONCILE, d.requeue_after)
    return result


def _emit(store: Store, e: PassEvent, now: float) -> None:
    store.emit(e.kind, e.message, source="control", model=e.model, profile=e.profile, ts=now, **e.data)


def _write_scaling(store: Store, s: Scaling, now: float) -> None:
    """One pipeline: each autoscaled profile's record and new sample, the records of profiles that
    no longer autoscale deleted; then a log line and events per change."""
    if not s.writes:
        return
    profiles = s.scale.profiles
    store.write_scaling({(p.model, p.profile): p.state for p in profiles},
                        {(p.model, p.profile): (p.sample.t, p.sample.to_list()) for p in profiles},
                        s.keep_since, HISTORY_MAX, s.forget)
    for p in profiles:
        if p.decision.changed:
            scale_log.info("autoscale %s/%s: %s", p.model, p.profile, p.decision.reason)
    for e in s.events:
        _emit(store, e, now)


def _write_adapters(store: Store, a: AdapterChanges, now: float) -> None:
    """Each runtime replica's new `adapters_wanted` (then its agent is woken to load or unload), the
    llama.cpp replicas to replace with another set, the events, the rows. One failed write is logged
    and the rest go on (the next pass writes it again)."""
    d = a.decision
    for rid, adapters in (d.wanted if d else {}).items():
        try:
            if store.update_replica(rid, adapters_wanted=list(adapters)):
                adapter_log.info("replica %s holds adapters %s from now on", rid, ", ".join(adapters) or "none")
                node = d.nodes.get(rid)
                if node:
                    store.wake_agent(node, rid)
        except Exception:  # noqa: BLE001 - the next pass writes it again
            adapter_log.exception("replica %s: cannot write its adapters", rid)
    for rid, adapters in (d.relaunch if d else {}).items():
        try:
            if store.update_replica(rid, adapters_relaunch=list(adapters)):
                why = f"replaced to hold adapters {', '.join(adapters) or 'none'} (llama.cpp loads them at launch)"
                adapter_log.info("replica %s: %s", rid, why)
                store.emit("adapters_relaunch", why, source="control", replica=rid, ts=now, adapters=list(adapters))
        except Exception:  # noqa: BLE001
            adapter_log.exception("replica %s: cannot mark it for a relaunch with other adapters", rid)
    for e in a.events:
        _emit(store, e, now)
    if a.rows is not None:
        store.write_adapter_rows([r.to_dict() for r in a.rows], now)
