"""The control plane's side effects: apply what a reconcile pass decided to Redis and the node queues,
and the three passes (reconcile, publish, housekeeping) the Celery tasks run.

Each pass reads once, decides once (a pure function) and writes what the decision returned: reconcile
is `load_snapshot` -> `reconcile.decide` -> `apply_reconcile`, publish is `Store.publish_view` ->
`publish.decide` -> `Store.write_publish`. Every action records its intent in the replica record
BEFORE the dispatch that acts on it, so a crash in between leaves a record the next pass repairs
(re-dispatching a stale launch or stop) instead of an engine nobody knows about. Each action is
applied on its own: one failure is logged and the rest go on.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Mapping, Protocol

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
from workers.control.external import external_endpoints
from workers.control.gcpause import paused_gc
from workers.control.migrations import run_pending
from workers.control.publish import LOST_GRACE, decide
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


@dataclass
class PublishMemory:
    """What one control worker process remembers between publish passes."""

    live: frozenset[str] | None = None  # the live nodes at the last pass


def publish_once(
    store: Store, now: Callable[[], float], lock_ttl: float = 10.0, catalogs: CatalogKeeper | None = None,
    kicker: Kicker | None = None, memory: PublishMemory | None = None, lost_grace: float | None = None,
) -> int | None:
    """Publish the routable endpoints if they changed (`publish.decide`, over one `Store.publish_view`,
    written by one `Store.write_publish`). Returns the new version, else None (also when no readable
    catalog was ever seen: the published list then stays as it is).

    The write also stamps `unpublished_version` on every replica asked to stop that the list no longer
    holds: its agent drains it once every gateway has loaded that version. And when the set of live
    nodes changed since this process's last pass (a node joined or was lost), it kicks a reconcile."""
    kicker = kicker or disabled()
    began = time.monotonic()
    with store.lock(keys.PUBLISH_LOCK, lock_ttl) as held:
        if not held:
            kicker.mark_dirty(PUBLISH)
            return None
        kicker.started(PUBLISH)
        version = None
        try:
            view = store.publish_view()
            loaded = (catalogs or CatalogKeeper()).accept(view.catalog)
            if loaded is None:
                return None
            catalog_version, catalog = loaded
            t = now()
            d = decide(catalog, catalog_version, view, t, external_endpoints(catalog, view.externals),
                       memory.live if memory is not None else None,
                       LOST_GRACE if lost_grace is None else lost_grace)
            current = store.write_publish(d.endpoints if d.changed else None, d.fingerprint, d.unpublish,
                                          view.version, t)
            if d.changed:
                version = current
                log.info("published %d endpoints as version %d", len(d.endpoints), version)
            if memory is not None:
                memory.live = d.live
            if d.nodes_changed:
                kicker.kick(RECONCILE)  # a node joined or went quiet: place or replace now
                # Housekeeping would notice too, up to its interval later.
                note_nodes(store, {n: t for n in d.lost}, d.returned, t)
            return version
        finally:
            kicker.finished(PUBLISH)
            store.count_pass("publish", time.monotonic() - began, 1 if version else 0)


@dataclass(frozen=True)
class Forget:
    """Housekeeping's decision about nodes without a heartbeat."""

    first_missing: Mapping[str, float] = field(default_factory=dict)  # start their clock now
    back: tuple[str, ...] = ()  # heartbeating again: clear their clock
    gone: tuple[str, ...] = ()  # forget them


def forget(
    nodes: Mapping[str, bool],
    missing_since: Mapping[str, float],
    referenced: AbstractSet[str],
    now: float,
    forget_after: float = 600.0,
) -> Forget:
    """Which nodes to forget. Pure. `nodes`: every known node -> live; `missing_since`: when a node was
    first seen without a heartbeat; `referenced`: nodes a replica record or an operator flag names.
    A node is forgotten once it has been missing `forget_after` seconds and nothing refers to it, so
    `llmgw status` keeps showing a recently gone node and one that still matters."""
    first: dict[str, float] = {}
    gone: list[str] = []
    for name in sorted(nodes):
        if nodes[name]:
            continue
        since = missing_since.get(name)
        if since is None:
            first[name] = now
        elif now - since >= forget_after and name not in referenced:
            gone.append(name)
    back = tuple(sorted(n for n in missing_since if nodes.get(n)))
    return Forget(first_missing=first, back=back, gone=tuple(gone))


def note_nodes(store: Store, first_missing: Mapping[str, float], back: AbstractSet[str] | tuple[str, ...],
               now: float) -> None:
    """Start (stop) the missing clock of nodes whose heartbeat expired (came back), and put each loss and
    return in the event history once, whichever control worker or pass noticed it first."""
    lost, returned = store.note_missing_nodes(first_missing, back)
    seen = store.nodes_last_seen() if lost else {}
    for n in lost:
        silent = f" for {now - seen[n]:.0f}s" if n in seen else ""
        store.emit("node_lost", f"no heartbeat{silent}; its replicas count as Lost", source="control", node=n, ts=now)
    for n in returned:
        store.emit("node_joined", "heartbeats again after it was lost", source="control", node=n, ts=now)


def housekeeping_once(store: Store, now: float, forget_after: float = 600.0) -> dict[str, int]:
    """Tidy what nobody else removes: load samples of deleted replicas (external urls keep theirs), nodes gone for `forget_after`
    seconds that nothing refers to any more (no replica record, no operator flag), and the per-node
    replica index (rebuilt from the records, which also indexes records written before it existed)."""
    replicas = store.all_replicas()
    stale_loads = store.delete_loads_except([*(r.id for r in replicas), *(x.id for x in store.external_records())])
    store.reindex_replica_nodes(replicas)
    known = store.known_nodes()
    live = store.live_nodes()
    admin = store.all_node_admin(sorted(known))
    referenced = {n for r in replicas for n in r.all_nodes}
    referenced |= {n for n, a in admin.items() if a.cordoned or a.draining}
    decision = forget({n: n in live for n in known}, store.nodes_missing_since(), referenced, now, forget_after)
    store.forget_nodes(decision.gone)
    note_nodes(store, decision.first_missing, decision.back, now)
    if stale_loads or decision.gone:
        log.info("housekeeping: %d stale load keys, forgot nodes %s", stale_loads, list(decision.gone))
    return {"loads": stale_loads, "nodes": len(decision.gone)}
