"""`plan(catalog, snapshot, now) -> list[Action]`: the three phases of one reconcile pass."""

from __future__ import annotations

import logging
from typing import Callable

from llmgw.catalog import Catalog
from workers.control.placement import ClusterView, NoPlacement
from workers.control.plan.actions import Action, StopReplica
from workers.control.plan.config import PlanConfig
from workers.control.plan.ids import default_id_factory
from workers.control.plan.placing import place_request, preemption
from workers.control.plan.profile import plan_profile
from workers.control.plan.requests import Request, cpu_order, gpu_order
from workers.control.plan.survey import survey
from workers.control.snapshot import Snapshot

log = logging.getLogger("llmgw.control.plan")


def plan(
    catalog: Catalog,
    snap: Snapshot,
    now: float,
    config: PlanConfig = PlanConfig(),
    new_id: Callable[[str, str], str] | None = None,
) -> list[Action]:
    """The actions that move the fleet one step toward `catalog`. Same inputs, same actions."""
    # --- phase 0: per record: derive its state, and the bookkeeping that needs no catalog ------------
    found = survey(catalog, snap, now, config)
    actions = found.actions
    new_id = new_id or default_id_factory(now, {r.id for r in snap.replicas})
    view = ClusterView.build(snap.nodes, snap.admin, found.allocated, found.active, joined=bool(snap.known))

    # --- phase 1: per profile, decide stops and how many to start ------------------------------------
    requests: list[Request] = []
    for model in catalog.models:
        for profile in model.profiles:
            try:
                recs = found.by_profile.get((model.name, profile.name), [])
                acts, reqs = plan_profile(model, profile, recs, found.states, snap, view, now, config,
                                          found.node_lists)
                actions.extend(acts)
                requests.extend(reqs)
            except Exception:
                log.exception("skipping profile %s/%s this pass", model.name, profile.name)

    stopping_now = {a.id for a in actions if isinstance(a, StopReplica)}
    pre = preemption(catalog, snap, found.states, found.node_lists, stopping_now)

    # --- phase 2: placement, highest priority first; CPU replicas after the GPU ones they count ------
    gpu = sorted((r for r in requests if r.req.gpu_class), key=gpu_order)
    cpu = sorted((r for r in requests if not r.req.gpu_class), key=cpu_order)
    failed: dict[tuple, NoPlacement] = {}
    for r in gpu + cpu:
        try:
            actions.extend(place_request(r, view, failed, new_id, pre))
        except Exception:
            log.exception("skipping a placement of %s/%s this pass", r.model.name, r.profile.name)
    return actions
