"""Phase two of `plan`: attempt each placement in turn against the pass's `ClusterView`; a GPU
replica that finds no room may preempt replicas of a strictly lower `scheduling_priority`
(workers.control.preempt)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llmgw.catalog import DRAIN_TIMEOUT, Catalog
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State
from workers.control.placement import ClusterView, NoPlacement, Placement, place_and_allocate, spread_many
from workers.control.plan.actions import (
    Action,
    CreateReplica,
    PlaceReplica,
    StopReplica,
    UpdatePending,
    planned_stop,
    rec_nodes,
)
from workers.control.plan.requests import Kind, Request
from workers.control.preempt import Holder, Preemptor
from workers.control.snapshot import Snapshot


@dataclass
class Preemption:
    """Phase two's preemption state: the pure `Preemptor` and how to stop each holder it may pick."""

    preemptor: Preemptor
    records: dict[str, tuple[ReplicaRecord, float]]  # id -> (record, its profile's drain_timeout)
    snap: Snapshot


def preemption(catalog: Catalog, snap: Snapshot, states: dict[str, State], node_lists: dict[str, list[str]],
               stopping_now: set[str]) -> Preemption:
    """Every replica holding GPUs on live nodes, and how many each profile can lose (its replicas
    holding GPUs above its min; a fixed profile's min is its `replicas`)."""
    profiles = {(m.name, p.name): p for m, p in catalog.profiles()}
    holders: list[Holder] = []
    records: dict[str, tuple[ReplicaRecord, float]] = {}
    held: dict[tuple[str, str], int] = {}
    for rec in snap.replicas:
        st = states.get(rec.id)
        if not rec.gpus or st is None or st in (State.STOPPED, State.LOST):
            continue
        nodes = node_lists.get(rec.id) or rec.all_nodes
        if not all(n in snap.nodes for n in nodes):
            continue
        prof = profiles.get((rec.model, rec.profile))
        stopping = rec.stop_requested_at is not None or rec.id in stopping_now or prof is None
        holders.append(Holder(rec.id, rec.model, rec.profile, prof.scheduling_priority if prof else 0,
                              {n: tuple(ix) for n, ix in rec.gpus.items()}, snap.replica_load.get(rec.id, 0.0),
                              stopping))
        if not stopping:
            records[rec.id] = (rec, prof.drain_timeout if prof else DRAIN_TIMEOUT)
            held[(rec.model, rec.profile)] = held.get((rec.model, rec.profile), 0) + 1
    budget = {key: max(0, n - profiles[key].min_replicas) for key, n in held.items()}
    return Preemption(Preemptor(holders, budget), records, snap)


def _make_room(r: Request, view: ClusterView, pre: Preemption | None) -> tuple[list[Action], str] | None:
    """A GPU replica that found no room: the stops that make room for it (drained like any planned
    stop) and the Pending reason that says what it waits for; None when nothing would make room."""
    if pre is None or not r.req.gpu_class:
        return None
    room = pre.preemptor.make_room(r.req, r.profile.scheduling_priority, view)
    if room is None:
        return None
    stops: list[Action] = []
    for h in room.stop:
        rec, drain_timeout = pre.records[h.id]
        why = (f"preempted for {r.model.name}/{r.profile.name} (scheduling_priority "
               f"{r.profile.scheduling_priority} > {h.scheduling_priority})")
        stops.append(planned_stop(rec, why, pre.snap, drain_timeout, event="replica_preempted"))
    return stops, room.reason


def _place_batch(r: Request, view: ClusterView, new_id: Callable[[str, str], str]) -> list[Action]:
    """A batch of new CPU replicas of one profile, spread in one go."""
    placed, missing = spread_many(r.req, view, r.count)
    gen = r.credential_generation
    out: list[Action] = [
        CreateReplica(new_id(r.model.name, r.profile.name), r.model.name, r.profile.name, r.spec_hash, p,
                      why=r.why, credential_generation=gen)
        for p in placed
    ]
    for _ in range(r.count - len(placed)):
        assert missing is not None
        out.append(CreateReplica(new_id(r.model.name, r.profile.name), r.model.name, r.profile.name,
                                 r.spec_hash, None, missing.reason, why=r.why, credential_generation=gen,
                                 refusals=missing.refusals))
    return out


def _move(r: Request, result: Placement | NoPlacement, new_id: Callable[[str, str], str]) -> list[Action]:
    """A crash-looping replica: a new one where it was placed, then the old one stopped; or nothing."""
    assert r.rec is not None
    if isinstance(result, NoPlacement):
        return []  # stays where it is; the agent keeps retrying it with backoff
    rid = new_id(r.model.name, r.profile.name)
    where = ", ".join(rec_nodes(r.rec))
    return [
        CreateReplica(rid, r.model.name, r.profile.name, r.spec_hash, result,
                      why=f"replaces {r.rec.id} (crash loop on {where})", moved_from=r.rec.id,
                      credential_generation=r.credential_generation),
        StopReplica(r.rec.id, f"crash loop on {where}; moved to {result.head} as {rid}",
                    rec_nodes(r.rec), drain_timeout=r.profile.drain_timeout, model=r.model.name),
    ]


def place_request(
    r: Request, view: ClusterView, failed: dict[tuple, NoPlacement], new_id: Callable[[str, str], str],
    pre: Preemption | None = None,
) -> list[Action]:
    """The actions of one request: placed, moved, Pending (with a reason), or making room first."""
    if r.count > 1:
        return _place_batch(r, view, new_id)
    result: Placement | NoPlacement | None = failed.get(r.req.key)
    if result is None:
        result = place_and_allocate(r.req, view)
        if isinstance(result, NoPlacement):
            # Capacity only shrinks during a pass: an identical request would fail the same way.
            failed[r.req.key] = result
    if r.kind is Kind.MOVE:
        return _move(r, result, new_id)
    stops: list[Action] = []
    reason = ""
    if isinstance(result, NoPlacement):
        room = _make_room(r, view, pre)
        stops, reason = room if room is not None else ([], result.reason)
    if r.kind is Kind.PENDING:
        assert r.rec is not None
        if isinstance(result, Placement):
            return [PlaceReplica(r.rec.id, result, r.model.name, r.profile.name)]
        if (reason != r.rec.pending_reason
                or [x.to_dict() for x in result.refusals] != r.rec.pending_refusals):
            return [*stops, UpdatePending(r.rec.id, reason, result.refusals)]
        return stops
    rid = new_id(r.model.name, r.profile.name)
    if isinstance(result, Placement):
        return [CreateReplica(rid, r.model.name, r.profile.name, r.spec_hash, result, why=r.why,
                              credential_generation=r.credential_generation)]
    return [*stops, CreateReplica(rid, r.model.name, r.profile.name, r.spec_hash, None, reason, why=r.why,
                                  credential_generation=r.credential_generation, refusals=result.refusals)]
