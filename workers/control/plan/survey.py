"""Phase zero of `plan`, per record: derive its state, and the bookkeeping that needs no catalog
profile (records asked to stop, records of profiles that left the catalog, launches to re-send)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmgw.catalog import Catalog
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State, derive
from workers.control.plan.actions import Action, DeleteRecord, DispatchLaunch, DispatchStop, planned_stop, rec_nodes
from workers.control.plan.config import PlanConfig
from workers.control.snapshot import Snapshot

log = logging.getLogger("llmgw.control.plan")


@dataclass
class Survey:
    """What phase zero found, for the phases after it."""

    states: dict[str, State] = field(default_factory=dict)
    node_lists: dict[str, list[str]] = field(default_factory=dict)  # rec.all_nodes, once per record per pass
    actions: list[Action] = field(default_factory=list)
    by_profile: dict[tuple[str, str], list[ReplicaRecord]] = field(default_factory=dict)
    allocated: list[tuple[str, str, dict[str, list[int]]]] = field(default_factory=list)  # for ClusterView
    active: list[tuple[str, list[str]]] = field(default_factory=list)  # for ClusterView


def survey(catalog: Catalog, snap: Snapshot, now: float, config: PlanConfig) -> Survey:
    out = Survey()
    states, node_lists, actions, by_profile = out.states, out.node_lists, out.actions, out.by_profile
    allocated, active = out.allocated, out.active
    wanted = {(m.name, p.name) for m in catalog.models for p in m.profiles}
    live = snap.nodes
    policy = config.crash_policy
    for rec in snap.replicas:
        counted = False
        try:
            nodes = node_lists[rec.id] = rec.all_nodes
            # `llmgw.state.replica_state.nodes_alive`, inlined: this loop runs once per replica of the
            # fleet every pass, where a call's overhead adds up (`python -m bench.scheduler`).
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
                actions.append(planned_stop(rec, why, snap))
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
    return out


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
        return [DispatchStop(rec.id, rec_nodes(rec))]
    if st is State.DRAINING and since >= rec.drain_timeout + config.stop_redispatch_after:
        return [DispatchStop(rec.id, rec_nodes(rec))]  # its agent should have ended the drain by now
    return []
