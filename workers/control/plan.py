"""The reconciler's brain: `plan(catalog, snapshot, now) -> list[Action]`. Pure: no Redis, no clock.

One pass compares, per catalog profile, the replicas wanted with the records that exist, and returns
the actions that move the fleet one step closer (docs/control-plane.md has the full rule set):

- start missing replicas, stop surplus ones (not yet Ready first, then the newest);
- replicas on a node whose heartbeat expired are Lost: unpublished and replaced at once, but asked to
  stop only once the replacements are Ready or the node has been gone `lost_grace` (so a heartbeat
  blip or a slow agent restart re-adopts them); a Lost record asked to stop is deleted after a grace;
- a crash-looping replica is moved when another eligible node can take it (the agent restarts a
  merely Failed one in place, with backoff);
- replicas of a model or profile that left the catalog are stopped;
- a replica whose spec changed, or whose node is draining or no longer matches, is outdated and
  replaced by a rolling update with a surge of one: a new one starts, and an old one is stopped only
  once a new one is Ready, so the profile never drops to zero Ready replicas;
- Stopped records are deleted; launches and stops still unconfirmed after a while are re-dispatched
  (harmless: the agent is level-based), which repairs a crash between recording and dispatching.

Placement happens last, over all profiles at once, highest `priority` first, so short capacity goes
to the profiles that matter most; nothing running is ever evicted to make room.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Union

from llmgw.catalog import Catalog, Model, Profile, profile_spec_hash
from llmgw.gpus import normalize_gpu_class
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import CrashPolicy, State, derive
from workers.control.placement import (
    ClusterView,
    NoPlacement,
    Placement,
    PlacementRequest,
    place_and_allocate,
    spread_many,
)
from workers.control.snapshot import Snapshot

log = logging.getLogger("llmgw.control.plan")


# --- actions ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CreateReplica:
    """Record a new replica (placed, or Pending with a reason), then dispatch its launch if placed."""

    id: str
    model: str
    profile: str
    spec_hash: str
    placement: Placement | None
    pending_reason: str | None = None
    why: str = ""  # "scale up", "replaces r1 (node-a lost)", ...

    def record(self, now: float) -> ReplicaRecord:
        """The control fields of the new record; `launch_dispatched_at` marks the intent to launch."""
        p = self.placement
        return ReplicaRecord(
            id=self.id,
            model=self.model,
            profile=self.profile,
            spec_hash=self.spec_hash,
            node=p.head if p else None,
            nodes=list(p.nodes) if p else [],
            gpus=p.gpus_dict() if p else {},
            created_at=now,
            pending_reason=None if p else self.pending_reason,
            launch_dispatched_at=now if p else None,
        )


@dataclass(frozen=True)
class PlaceReplica:
    """A Pending record found room: write its node and GPUs, then dispatch its launch."""

    id: str
    placement: Placement


@dataclass(frozen=True)
class UpdatePending:
    """A Pending record still has no room, for a different reason than the one it shows."""

    id: str
    reason: str


@dataclass(frozen=True)
class StopReplica:
    """Record the stop request (time and reason), then dispatch `llmgw.stop` to its nodes."""

    id: str
    reason: str
    nodes: tuple[str, ...] = ()
    dispatch: bool = True  # False when its nodes are not live: nobody would consume it now


@dataclass(frozen=True)
class DeleteRecord:
    id: str
    reason: str = ""


@dataclass(frozen=True)
class DispatchLaunch:
    """Send the launch again: still Launching a while after the last dispatch."""

    id: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class DispatchStop:
    """Send the stop again: still Stopping a while after it was requested."""

    id: str
    nodes: tuple[str, ...]


Action = Union[CreateReplica, PlaceReplica, UpdatePending, StopReplica, DeleteRecord, DispatchLaunch, DispatchStop]


@dataclass(frozen=True)
class PlanConfig:
    """Knobs of the reconciler (seconds). See docs/control-plane.md."""

    launch_redispatch_after: float = 5.0
    stop_redispatch_after: float = 10.0
    lost_delete_after: float = 60.0  # a Lost record that was asked to stop is deleted after this
    lost_grace: float = 60.0  # a Lost replica is asked to stop this long after its node's last heartbeat
    crash_policy: CrashPolicy = field(default_factory=CrashPolicy)


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


def _rec_nodes(rec: ReplicaRecord) -> tuple[str, ...]:
    return tuple(rec.all_nodes)


def legacy_spec_hash(model: Model, profile: Profile) -> str:
    """The spec hash of records written before `profile_spec_hash` left out routing-only fields
    (metrics, start_timeout, pool, node_selector). Such a record is current while its profile is
    unchanged, so upgrading llmgw does not restart the fleet."""
    spec = profile.model_dump(mode="json", by_alias=True, exclude={"replicas", "priority", "weight"})
    spec["_model"] = {"name": model.name, "aliases": model.aliases, "source": model.source_for(profile)}
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:40] or "x"


def default_id_factory(now: float, taken: set[str]) -> Callable[[str, str], str]:
    """Deterministic ids (same inputs, same ids) that never collide with `taken`."""
    counter = [0]
    prefixes: dict[tuple[str, str], str] = {}
    stem = hashlib.sha1(repr(now).encode()).hexdigest()[:6]  # differs from pass to pass

    def new_id(model: str, profile: str) -> str:
        prefix = prefixes.get((model, profile))
        if prefix is None:
            prefix = prefixes[(model, profile)] = f"{_slug(model)}-{_slug(profile)}-{stem}"
        while True:
            counter[0] += 1
            rid = f"{prefix}{counter[0]:02x}"
            if rid not in taken:
                taken.add(rid)
                return rid

    return new_id


@dataclass
class _Request:
    """One placement to attempt in phase two."""

    sort_key: tuple
    kind: str  # "new" | "pending" | "move"
    model: Model
    profile: Profile
    spec_hash: str
    req: PlacementRequest
    rec: ReplicaRecord | None = None
    why: str = ""
    count: int = 1  # "new" CPU requests come as one batch per profile


def plan(
    catalog: Catalog,
    snap: Snapshot,
    now: float,
    config: PlanConfig = PlanConfig(),
    new_id: Callable[[str, str], str] | None = None,
) -> list[Action]:
    """The actions that move the fleet one step toward `catalog`. Same inputs, same actions."""
    # A pass allocates many small objects next to a large snapshot; a full cyclic-GC sweep in the
    # middle would cost more than the pass itself, and the pass makes no reference cycles.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(catalog, snap, now, config, new_id)
    finally:
        if was_enabled:
            gc.enable()


def _plan(
    catalog: Catalog,
    snap: Snapshot,
    now: float,
    config: PlanConfig,
    new_id: Callable[[str, str], str] | None,
) -> list[Action]:
    states: dict[str, State] = {}
    node_lists: dict[str, list[str]] = {}  # rec.all_nodes, computed once per record per pass
    actions: list[Action] = []
    by_profile: dict[tuple[str, str], list[ReplicaRecord]] = {}
    allocated = []
    active = []
    wanted = {(m.name, p.name) for m in catalog.models for p in m.profiles}
    live = snap.nodes
    policy = config.crash_policy

    # --- phase 0: per record: derive its state, and the bookkeeping that needs no catalog ------------
    for rec in snap.replicas:
        counted = False
        try:
            nodes = node_lists[rec.id] = rec.all_nodes
            # `llmgw.state.replica_state.nodes_alive`, inlined: this loop runs once per replica of the
            # fleet every pass, and the call costs 15 ms per 10,000 replicas (bench/scheduler.py).
            alive = True
            for n in nodes:
                if n not in live:
                    alive = False
                    break
            st = states[rec.id] = derive(rec, alive, now, policy).state
            if rec.gpus and st is not State.STOPPED:
                allocated.append((rec.model, rec.id, rec.gpus))
                counted = True
            if rec.stop_requested_at is not None:
                actions.extend(_stopping_upkeep(rec, st, now, config))
                continue
            if alive and nodes:
                active.append((rec.model, nodes))
            if (rec.model, rec.profile) not in wanted:
                model = catalog.model(rec.model)
                why = (
                    f'model "{rec.model}" left the catalog'
                    if model is None
                    else f'profile "{rec.profile}" left model "{rec.model}"'
                )
                actions.append(_stop(rec, why, snap))
                continue
            group = by_profile.get((rec.model, rec.profile))
            if group is None:
                group = by_profile[(rec.model, rec.profile)] = []
            group.append(rec)
            if st is State.LAUNCHING:
                since = rec.launch_dispatched_at or rec.created_at
                if now - since >= config.launch_redispatch_after:
                    actions.append(DispatchLaunch(rec.id, tuple(nodes)))
        except Exception:  # one bad record must not stop the pass
            log.exception("skipping replica %s (%s/%s) this pass", rec.id, rec.model, rec.profile)
            if not counted and isinstance(rec.gpus, dict) and rec.gpus:
                allocated.append((rec.model, rec.id, rec.gpus))  # its GPUs may be in use: never reuse
    new_id = new_id or default_id_factory(now, {r.id for r in snap.replicas})

    view = ClusterView.build(snap.nodes, snap.admin, allocated, active)

    # --- phase 1: per profile, decide stops and how many to start ------------------------------------
    requests: list[_Request] = []
    for model in catalog.models:
        for profile in model.profiles:
            try:
                recs = by_profile.get((model.name, profile.name), [])
                acts, reqs = _plan_profile(model, profile, recs, states, snap, view, now, config, node_lists)
                actions.extend(acts)
                requests.extend(reqs)
            except Exception:
                log.exception("skipping profile %s/%s this pass", model.name, profile.name)

    # --- phase 2: placement, highest priority first ---------------------------------------------------
    # GPU requests compete for capacity: highest priority first, and within a priority each profile
    # gets its first replica before any gets its second. CPU replicas take no capacity (they are only
    # spread), so they go after the GPU ones, which they count, one profile at a time.
    gpu = sorted((r for r in requests if r.req.gpu_class), key=lambda r: r.sort_key)
    cpu = sorted(
        (r for r in requests if not r.req.gpu_class),
        key=lambda r: (r.sort_key[0], r.sort_key[3], r.sort_key[4], r.sort_key[1], r.sort_key[2]),
    )
    failed: dict[tuple, str] = {}
    for r in gpu + cpu:
        try:
            actions.extend(_place(r, view, failed, new_id))
        except Exception:
            log.exception("skipping a placement of %s/%s this pass", r.model.name, r.profile.name)
    return actions


def _stop(rec: ReplicaRecord, reason: str, snap: Snapshot) -> Action:
    if rec.node is None:  # never placed: nothing runs, nothing to tell an agent
        return DeleteRecord(rec.id, reason)
    nodes = _rec_nodes(rec)
    return StopReplica(rec.id, reason, nodes, dispatch=all(n in snap.nodes for n in nodes))


def _stopping_upkeep(rec: ReplicaRecord, st: State, now: float, config: PlanConfig) -> list[Action]:
    """Records asked to stop: delete when Stopped (or Lost for long), nudge the agent when slow."""
    since = now - (rec.stop_requested_at or now)
    if st is State.STOPPED:
        return [DeleteRecord(rec.id, "stopped")]
    if st is State.LOST:
        if since >= config.lost_delete_after:
            # If its node ever returns, that agent stops engines that have no record.
            return [DeleteRecord(rec.id, "stop unconfirmed: node gone")]
        return []
    if st is State.STOPPING and since >= config.stop_redispatch_after:
        return [DispatchStop(rec.id, _rec_nodes(rec))]
    return []


def _outdated(
    rec: ReplicaRecord, profile: Profile, is_current: Callable[[str], bool], snap: Snapshot, nodes: list[str]
) -> str | None:
    """Why a live replica should be replaced (spec changed, node draining or no longer matching).
    `nodes` is `rec.all_nodes`."""
    if not is_current(rec.spec_hash):
        return "spec changed"
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


def _order_to_stop(recs: Iterable[ReplicaRecord], states: dict[str, State]) -> list[ReplicaRecord]:
    """Not yet Ready first (Pending, then broken, then starting), then the newest."""
    return sorted(recs, key=lambda r: (_STOP_RANK.get(states[r.id], 2), -r.created_at, r.id))


def _plan_profile(
    model: Model,
    profile: Profile,
    recs: list[ReplicaRecord],
    states: dict[str, State],
    snap: Snapshot,
    view: ClusterView,
    now: float = 0.0,
    config: PlanConfig = PlanConfig(),
    node_lists: dict[str, list[str]] | None = None,
) -> tuple[list[Action], list[_Request]]:
    actions: list[Action] = []
    target = profile_spec_hash(model, profile)
    legacy: list[str] = []  # computed only when a record does not carry the current hash

    def is_current(spec_hash: str) -> bool:
        if spec_hash == target:
            return True
        if not legacy:
            legacy.append(legacy_spec_hash(model, profile))
        return spec_hash == legacy[0]

    desired = profile.replicas
    cur: list[ReplicaRecord] = []
    old: list[tuple[ReplicaRecord, str]] = []
    lost: list[ReplicaRecord] = []
    for rec in recs:  # in id order (the snapshot's), which keeps the plan deterministic
        st = states[rec.id]
        if st is State.LOST:
            lost.append(rec)  # not counted toward `desired`: replaced at once, stopped below
            continue
        nodes = node_lists[rec.id] if node_lists is not None else rec.all_nodes
        why = _outdated(rec, profile, is_current, snap, nodes)
        if why:
            old.append((rec, why))
        else:
            cur.append(rec)

    def is_ready(r: ReplicaRecord) -> bool:
        return states[r.id] is State.READY

    # Surplus current replicas.
    if len(cur) > desired:
        surplus = _order_to_stop(cur, states)[: len(cur) - desired]
        gone = {r.id for r in surplus}
        for r in surplus:
            actions.append(_stop(r, f"scale down to {desired}", snap))
        cur = [r for r in cur if r.id not in gone]

    ready_cur = sum(1 for r in cur if is_ready(r))
    req = PlacementRequest.for_profile(model.name, profile)
    if old:
        # Rolling: at most one replica above `desired` (surge of one), and an old replica is kept
        # for every new one that is not Ready yet.
        start = max(0, min(desired - len(cur), desired + 1 - len(cur) - len(old)))
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
            actions.append(_stop(r, f"replaced: {reasons[r.id]}", snap))
        ready_left = ready_after
    else:
        start = max(0, desired - len(cur))
        ready_left = ready_cur
    if lost:
        actions.extend(_settle_lost(lost, desired, ready_left, snap, now, config))

    requests: list[_Request] = []
    ordinal = 0

    def key(kind_order: int) -> tuple:
        return (-profile.priority, ordinal, kind_order, model.name, profile.name)

    for r in cur:
        st = states[r.id]
        if st is State.PENDING:
            requests.append(_Request(key(1), "pending", model, profile, target, req, rec=r))
            ordinal += 1
        elif st is State.CRASHLOOP:
            move = PlacementRequest.for_profile(model.name, profile, exclude=_rec_nodes(r))
            requests.append(_Request(key(0), "move", model, profile, target, move, rec=r))
            ordinal += 1
    why = f"rolling replacement ({old[0][1]})" if old else "scale up"
    if req.gpu_class:
        for _ in range(start):
            requests.append(_Request(key(2), "new", model, profile, target, req, why=why))
            ordinal += 1
    elif start:
        # CPU replicas compete for nothing: place them as one batch (same result, far less overhead).
        requests.append(_Request(key(2), "new", model, profile, target, req, why=why, count=start))
    return actions, requests


def lost_since(rec: ReplicaRecord, snap: Snapshot) -> float:
    """When a Lost replica's first node went quiet: that node's last heartbeat, or (for a node with no
    recorded heartbeat time) the latest fact in the record."""
    seen = [snap.last_seen[n] for n in rec.all_nodes if n not in snap.nodes and n in snap.last_seen]
    if seen:
        return min(seen)
    facts = (rec.created_at, rec.launch_dispatched_at, rec.started_at, rec.last_probe_at, rec.adopted_at)
    return max((t for t in facts if t is not None), default=0.0)


def _settle_lost(
    lost: list[ReplicaRecord], desired: int, ready: int, snap: Snapshot, now: float, config: PlanConfig
) -> list[Action]:
    """Lost replicas of one profile: ask to stop those whose replacements are Ready (the profile has
    `desired` Ready replicas without them) and those lost for `lost_grace`; keep the rest, so a node
    that comes back soon keeps its engines and the surplus rule settles the count."""
    out: list[Action] = []
    keep = max(0, desired - ready)  # Lost replicas still standing in for a replacement not Ready yet
    by_age = sorted(lost, key=lambda r: (lost_since(r, snap), r.id))
    for i, rec in enumerate(by_age):
        gone = ", ".join(n for n in _rec_nodes(rec) if n not in snap.nodes)
        lost_for = now - lost_since(rec, snap)
        if lost_for >= config.lost_grace:
            out.append(_stop(rec, f"node {gone} lost for {lost_for:.0f}s; replaced", snap))
        elif i < len(by_age) - keep:  # the longest lost go first
            out.append(_stop(rec, f"node {gone} lost; replacement Ready", snap))
    return out


def _freeing_helps(rec: ReplicaRecord, req: PlacementRequest, view: ClusterView) -> bool:
    """Would stopping `rec` make room for `req`? Only GPUs are capacity: CPU placement never waits
    for room, and a replica on a node the request cannot use (draining, other pool) frees nothing."""
    if not req.gpu_class or not rec.gpus:
        return False
    nodes = [n for n in _rec_nodes(rec) if n in view.nodes]
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


def _place(
    r: _Request, view: ClusterView, failed: dict[tuple, str], new_id: Callable[[str, str], str]
) -> list[Action]:
    if r.count > 1:
        placed, missing = spread_many(r.req, view, r.count)
        out: list[Action] = [
            CreateReplica(new_id(r.model.name, r.profile.name), r.model.name, r.profile.name, r.spec_hash, p,
                          why=r.why)
            for p in placed
        ]
        for _ in range(r.count - len(placed)):
            assert missing is not None
            out.append(CreateReplica(new_id(r.model.name, r.profile.name), r.model.name, r.profile.name,
                                     r.spec_hash, None, missing.reason, why=r.why))
        return out
    reason = failed.get(r.req.key)
    result: Placement | NoPlacement
    if reason is None:
        result = place_and_allocate(r.req, view)
        if isinstance(result, NoPlacement):
            # Capacity only shrinks during a pass: an identical request would fail the same way.
            failed[r.req.key] = result.reason
    else:
        result = NoPlacement(reason)

    if r.kind == "move":
        assert r.rec is not None
        if isinstance(result, NoPlacement):
            return []  # stays where it is; the agent keeps retrying it with backoff
        rid = new_id(r.model.name, r.profile.name)
        where = ", ".join(_rec_nodes(r.rec))
        return [
            CreateReplica(rid, r.model.name, r.profile.name, r.spec_hash, result,
                          why=f"replaces {r.rec.id} (crash loop on {where})"),
            StopReplica(r.rec.id, f"crash loop on {where}; moved to {result.head} as {rid}",
                        _rec_nodes(r.rec)),
        ]
    if r.kind == "pending":
        assert r.rec is not None
        if isinstance(result, Placement):
            return [PlaceReplica(r.rec.id, result)]
        if result.reason != r.rec.pending_reason:
            return [UpdatePending(r.rec.id, result.reason)]
        return []
    rid = new_id(r.model.name, r.profile.name)
    if isinstance(result, Placement):
        return [CreateReplica(rid, r.model.name, r.profile.name, r.spec_hash, result, why=r.why)]
    return [CreateReplica(rid, r.model.name, r.profile.name, r.spec_hash, None, result.reason, why=r.why)]
