"""Phase one of `plan`, per catalog profile: which of its replicas to stop (surplus, outdated, Lost)
and which placements to attempt (new replicas, Pending records, crash loops to move)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping

from llmgw.catalog import DRAIN_TIMEOUT, Model, Profile, profile_spec_hash
from llmgw.catalog.spec import legacy_spec_hash
from llmgw.gpus import normalize_gpu_class
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State
from workers.control.placement import ClusterView, PlacementRequest
from workers.control.plan.actions import Action, planned_stop, rec_nodes
from workers.control.plan.config import PlanConfig
from workers.control.plan.requests import Kind, Order, Request
from workers.control.plan.weights import on_unhealthy_gpu, weights_terms
from workers.control.publish import lost_since
from workers.control.snapshot import Snapshot

# How eagerly a replica is chosen to go when there are too many: lower goes first.
_STOP_RANK = {
    State.PENDING: 0,
    State.CRASHLOOP: 1,
    State.FAILED: 1,
    State.LAUNCHING: 2,
    State.STARTING: 2,
    State.UNHEALTHY: 2,
    State.READY: 3,
}


def _outdated(
    rec: ReplicaRecord, profile: Profile, is_current: Callable[[str], bool], snap: Snapshot, nodes: list[str],
    credential_generation: int = 0,
) -> str | None:
    """Why a live replica should be replaced (spec changed, credentials rotated, node draining or no
    longer matching). `nodes` is `rec.all_nodes`."""
    if not is_current(rec.spec_hash):
        return "spec changed"
    if rec.credential_generation < credential_generation:
        return "engine credentials rotated"
    if rec.adapters_relaunch is not None:
        return f"its LoRA adapters change to {', '.join(rec.adapters_relaunch) or 'none'}"
    for n in nodes:
        admin = snap.admin.get(n)
        if admin is not None and admin.draining:
            return f"node {n} is draining"
        info = snap.nodes.get(n)
        if info is not None:
            if info.pool != profile.pool:
                return f'node {n} left pool "{profile.pool}"'
            if profile.node_selector and any(info.labels.get(k) != v for k, v in profile.node_selector.items()):
                return f"node {n} no longer matches node_selector"
    return None


def _order_to_stop(recs: Iterable[ReplicaRecord], states: dict[str, State],
                   loads: Mapping[str, float] | None = None) -> list[ReplicaRecord]:
    """Not yet Ready first (Pending, then broken, then starting), then the least loaded (when loads
    are known: fewer requests to drain), then the newest."""
    loads = loads or {}
    return sorted(recs, key=lambda r: (_STOP_RANK.get(states[r.id], 2), loads.get(r.id, 0.0), -r.created_at, r.id))


def plan_profile(
    model: Model,
    profile: Profile,
    recs: list[ReplicaRecord],
    states: dict[str, State],
    snap: Snapshot,
    view: ClusterView,
    now: float = 0.0,
    config: PlanConfig = PlanConfig(),
    node_lists: dict[str, list[str]] | None = None,
) -> tuple[list[Action], list[Request]]:
    """The stops of one profile's replicas, and the placements it asks for."""
    actions: list[Action] = []
    target = profile_spec_hash(model, profile)
    legacy: list[str] = []  # computed only when a record does not carry the current hash

    def is_current(spec_hash: str) -> bool:
        if spec_hash == target:
            return True
        if not legacy:
            legacy.append(legacy_spec_hash(model, profile))
        return spec_hash == legacy[0]

    desired = snap.wanted.get((model.name, profile.name), profile.replicas)
    generation = snap.credential_generation(model.name)
    cur: list[ReplicaRecord] = []
    old: list[tuple[ReplicaRecord, str]] = []
    lost: list[ReplicaRecord] = []
    for rec in recs:  # in id order (the snapshot's), which keeps the plan deterministic
        st = states[rec.id]
        if st is State.LOST:
            lost.append(rec)  # not counted toward `desired`: replaced at once, stopped below
            continue
        nodes = node_lists[rec.id] if node_lists is not None else rec.all_nodes
        why = _outdated(rec, profile, is_current, snap, nodes, generation) or \
            on_unhealthy_gpu(rec, view.unhealthy)
        if why:
            old.append((rec, why))
        else:
            cur.append(rec)

    def is_ready(r: ReplicaRecord) -> bool:
        return states[r.id] is State.READY

    # Surplus current replicas.
    if len(cur) > desired:
        surplus = _order_to_stop(cur, states, snap.replica_load)[: len(cur) - desired]
        gone = {r.id for r in surplus}
        for r in surplus:
            actions.append(planned_stop(r, f"scale down to {desired}", snap, profile.drain_timeout))
        cur = [r for r in cur if r.id not in gone]

    ready_cur = sum(1 for r in cur if is_ready(r))
    req = weights_terms(PlacementRequest.for_profile(model.name, profile), model, profile, snap)
    if old:
        # Rolling: at most one replica above `desired` (surge of one), and an old replica is kept
        # for every new one that is not Ready yet.
        keep_old = max(0, desired - ready_cur)
        reasons = {r.id: why for r, why in old}
        ordered = _order_to_stop([r for r, _ in old], states)
        to_stop = ordered[: max(0, len(old) - keep_old)]
        if not to_stop and any(states[r.id] is State.PENDING for r in cur):
            # The new replica cannot be placed. If an old one holds capacity it could use, let that
            # one go first (the guard below keeps another replica Ready).
            helpful = [r for r in ordered if _freeing_helps(r, req, view)]
            to_stop = helpful[:1]
        ready_total = ready_cur + sum(1 for r, _ in old if is_ready(r))
        ready_after = ready_total - sum(1 for r in to_stop if is_ready(r))
        while desired > 0 and ready_total > 0 and ready_after < 1 and to_stop:
            # Never take the profile to zero Ready replicas during an update.
            last = to_stop.pop()
            ready_after += 1 if is_ready(last) else 0
        for r in to_stop:
            actions.append(planned_stop(r, f"replaced: {reasons[r.id]}", snap, profile.drain_timeout))
        # The surge counts the old replicas left after these stops: the next pass would count them
        # so, and deciding it now keeps a pass applied from leaving work for the same moment.
        start = max(0, min(desired - len(cur), desired + 1 - len(cur) - (len(old) - len(to_stop))))
        ready_left = ready_after
    else:
        start = max(0, desired - len(cur))
        ready_left = ready_cur
    if lost:
        actions.extend(_settle_lost(lost, desired, ready_left, snap, now, config, profile.drain_timeout))
    why = f"rolling replacement ({old[0][1]})" if old else "scale up"
    return actions, _requests(model, profile, cur, states, target, req, start, why, generation)


def _requests(model: Model, profile: Profile, cur: list[ReplicaRecord], states: dict[str, State], target: str,
              req: PlacementRequest, start: int, why: str, generation: int) -> list[Request]:
    """The profile's placements: its Pending records, its crash loops to move, `start` new replicas."""
    requests: list[Request] = []
    ordinal = 0

    def order(kind: Kind) -> Order:
        return Order(-profile.scheduling_priority, -profile.priority, ordinal, kind, model.name, profile.name)

    for r in cur:
        st = states[r.id]
        if st is State.PENDING:
            requests.append(Request(order(Kind.PENDING), Kind.PENDING, model, profile, target, req, rec=r))
            ordinal += 1
        elif st is State.CRASHLOOP:
            move = dataclasses.replace(req, exclude=frozenset(rec_nodes(r)))
            requests.append(Request(order(Kind.MOVE), Kind.MOVE, model, profile, target, move, rec=r,
                                    credential_generation=generation))
            ordinal += 1
    if req.gpu_class:
        for _ in range(start):
            requests.append(Request(order(Kind.NEW), Kind.NEW, model, profile, target, req, why=why,
                                    credential_generation=generation))
            ordinal += 1
    elif start:
        # CPU replicas compete for nothing: place them as one batch (same result, far less overhead).
        requests.append(Request(order(Kind.NEW), Kind.NEW, model, profile, target, req, why=why, count=start,
                                credential_generation=generation))
    return requests


def _settle_lost(
    lost: list[ReplicaRecord], desired: int, ready: int, snap: Snapshot, now: float, config: PlanConfig,
    drain_timeout: float = DRAIN_TIMEOUT,
) -> list[Action]:
    """Lost replicas of one profile: ask to stop those whose replacements are Ready (the profile has
    `desired` Ready replicas without them) and those lost for `lost_grace`; keep the rest, so a node
    that comes back soon keeps its engines and the surplus rule settles the count."""
    out: list[Action] = []
    keep = max(0, desired - ready)  # Lost replicas still standing in for a replacement not Ready yet
    by_age = sorted(lost, key=lambda r: (lost_since(r, snap.nodes, snap.last_seen), r.id))
    for i, rec in enumerate(by_age):
        gone = ", ".join(n for n in rec_nodes(rec) if n not in snap.nodes)
        lost_for = now - lost_since(rec, snap.nodes, snap.last_seen)
        if lost_for >= config.lost_grace:
            out.append(planned_stop(rec, f"node {gone} lost for {lost_for:.0f}s; replaced", snap, drain_timeout))
        elif i < len(by_age) - keep:  # the longest lost go first
            out.append(planned_stop(rec, f"node {gone} lost; replacement Ready", snap, drain_timeout))
    return out


def _freeing_helps(rec: ReplicaRecord, req: PlacementRequest, view: ClusterView) -> bool:
    """Would stopping `rec` make room for `req`? Only GPUs are capacity: CPU placement never waits
    for room, and a replica on a node the request cannot use (draining, other pool) frees nothing."""
    if not req.gpu_class or not rec.gpus:
        return False
    nodes = [n for n in rec_nodes(rec) if n in view.nodes]
    if len(nodes) < req.nodes:
        return False
    for n in nodes:
        if not view.eligible(n, req):
            return False
        classes = {g.index: g.gpu_class for g in view.nodes[n].gpus}
        freed = sum(1 for i in rec.gpus.get(n, ()) if normalize_gpu_class(classes.get(i, "")) == req.gpu_class)
        if view.free_gpus(n, req.gpu_class) + freed < req.gpu_count:
            return False
    return True
