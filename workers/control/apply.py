"""The control plane's side effects: apply planned actions to Redis and the node queues, and the three
passes (reconcile, publish, housekeeping) the Celery tasks run.

Every action records its intent in the replica record BEFORE the dispatch that acts on it, so a crash
in between leaves a record the next pass repairs (re-dispatching a stale launch or stop) instead of an
engine nobody knows about. Each action is applied on its own: one failure is logged and the rest go on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Mapping, Protocol

from llmgw.state import keys
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
    plan,
)
from workers.control.publish import endpoints_from, fingerprint
from workers.control.snapshot import CatalogKeeper, load_snapshot

log = logging.getLogger("llmgw.control")


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
) -> ApplyResult:
    """Apply each action; stop early when `out_of_time()` says so (the rest is planned again next
    pass from fresh facts, so deferring is safe, while overrunning the pass lock would not be)."""
    result = ApplyResult()
    for i, action in enumerate(actions):
        if out_of_time():
            result.deferred = len(actions) - i
            log.warning("apply budget spent: %d actions deferred to the next pass", result.deferred)
            break
        try:
            _apply_one(action, store, dispatcher, now)
            result.add(action)
        except Exception:  # one bad action must not stop the others
            result.failed += 1
            log.exception("failed to apply %r", action)
    return result


def _apply_one(action: Action, store: Store, dispatcher: Dispatcher, now: float) -> None:
    if isinstance(action, CreateReplica):
        store.create_replica(action.record(now))  # the record first ...
        if action.placement is not None:
            log.info("launch %s (%s/%s) on %s: %s", action.id, action.model, action.profile,
                     ",".join(action.placement.nodes), action.why)
            for node in action.placement.nodes:  # ... then the dispatch
                dispatcher.launch(action.id, node)
        else:
            log.info("pending %s (%s/%s): %s", action.id, action.model, action.profile, action.pending_reason)
    elif isinstance(action, PlaceReplica):
        p = action.placement
        if store.update_replica(action.id, node=p.head, nodes=list(p.nodes), gpus=p.gpus_dict(),
                                pending_reason=None, launch_dispatched_at=now):
            log.info("launch %s on %s (was pending)", action.id, ",".join(p.nodes))
            for node in p.nodes:
                dispatcher.launch(action.id, node)
    elif isinstance(action, UpdatePending):
        store.update_replica(action.id, pending_reason=action.reason)
    elif isinstance(action, StopReplica):
        if store.update_replica(action.id, stop_requested_at=now, stop_reason=action.reason):
            log.info("stop %s: %s", action.id, action.reason)
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
def reconcile_once(
    store: Store,
    dispatcher: Dispatcher,
    now: Callable[[], float],
    lock_ttl: float = 30.0,
    config: PlanConfig = PlanConfig(),
    catalog_sync: Callable[[], object] | None = None,
    monotonic: Callable[[], float] = time.monotonic,
    catalogs: CatalogKeeper | None = None,
) -> ApplyResult | None:
    """One reconcile pass under the reconcile lock; None when another pass holds it (or no readable
    catalog was ever seen by `catalogs`, the process's CatalogKeeper). Applying stops at half the
    lock's TTL, so a huge pass (a cold start of thousands of replicas) never outlives its lock and
    overlaps the next one."""
    started = monotonic()
    with store.lock(keys.RECONCILE_LOCK, lock_ttl) as held:
        if not held:
            log.info("reconcile skipped: another pass holds the lock")
            return None
        if catalog_sync is not None:
            try:
                catalog_sync()
            except Exception:  # a bad catalog file must not stop the fleet being reconciled
                log.exception("catalog file sync failed; reconciling the applied catalog")
        loaded = (catalogs or CatalogKeeper()).load(store)
        if loaded is None:
            return None
        _version, catalog = loaded
        t = now()
        snap = load_snapshot(store, t)
        if not store.replica_node_index_ready():
            try:  # once per Redis: index records written before the per-node index existed
                store.reindex_replica_nodes(snap.replicas)
            except Exception:  # the agents keep scanning every record meanwhile: slower, not wrong
                log.exception("building the per-node replica index failed; retried next pass")
        actions = plan(catalog, snap, t, config)
        budget = lock_ttl / 2
        result = apply_actions(actions, store, dispatcher, t, lambda: monotonic() - started > budget)
        if result.applied or result.failed or result.deferred:
            log.info("reconcile: %s applied, %s failed, %s deferred %s", result.applied, result.failed,
                     result.deferred, result.counts)
        return result


def publish_once(
    store: Store, now: Callable[[], float], lock_ttl: float = 10.0, catalogs: CatalogKeeper | None = None
) -> int | None:
    """Publish the routable endpoints if they changed. Returns the new version, else None (also when
    no readable catalog was ever seen: the published list then stays as it is)."""
    with store.lock(keys.PUBLISH_LOCK, lock_ttl) as held:
        if not held:
            return None
        loaded = (catalogs or CatalogKeeper()).load(store)
        if loaded is None:
            return None
        _version, catalog = loaded
        t = now()
        eps = endpoints_from(catalog, store.all_replicas(), store.live_nodes(), t)
        fp = fingerprint(eps)
        _v, published_fp, _eps = store.read_endpoints()
        if fp == published_fp:
            return None
        version = store.write_endpoints(eps, fp, t)
        log.info("published %d endpoints as version %d", len(eps), version)
        return version


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


def housekeeping_once(store: Store, now: float, forget_after: float = 600.0) -> dict[str, int]:
    """Tidy what nobody else removes: load samples of deleted replicas, nodes gone for `forget_after`
    seconds that nothing refers to any more (no replica record, no operator flag), and the per-node
    replica index (rebuilt from the records, which also indexes records written before it existed)."""
    replicas = store.all_replicas()
    stale_loads = store.delete_loads_except(r.id for r in replicas)
    store.reindex_replica_nodes(replicas)
    known = store.known_nodes()
    live = store.live_nodes()
    admin = store.all_node_admin(sorted(known))
    referenced = {n for r in replicas for n in r.all_nodes}
    referenced |= {n for n, a in admin.items() if a.cordoned or a.draining}
    decision = forget({n: n in live for n in known}, store.nodes_missing_since(), referenced, now, forget_after)
    store.forget_nodes(decision.gone)
    store.note_missing_nodes(decision.first_missing, decision.back)
    if stale_loads or decision.gone:
        log.info("housekeeping: %d stale load keys, forgot nodes %s", stale_loads, list(decision.gone))
    return {"loads": stale_loads, "nodes": len(decision.gone)}
