"""The autoscaling step of a reconcile pass: read the demand, decide (workers.control.autoscale), record.

One read of what the decisions need (the autoscaler's states and recent samples, the gateways'
reports, the engines' loads, cold-start hints), one pure call (`decide_all`), one pipeline of writes
(each profile's sample and state), then an event and a log line for every change. The counts and
the replicas' loads go into the snapshot the planner reads.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from llmgw.catalog import Catalog
from llmgw.state.store import Store
from workers.control.autoscale import HISTORY_MAX, Sample, ScalePass, ScaleSpec, autoscaled, decide_all
from workers.control.snapshot import Snapshot

log = logging.getLogger("llmgw.control.autoscale")


def autoscale_step(store: Store, catalog: Catalog, snap: Snapshot, now: float) -> tuple[Snapshot, float | None]:
    """The snapshot with the autoscaler's counts (`wanted`) and the replicas' loads filled in, and when
    a pass should look again (a load above target whose `scale_up_after` has not run out yet)."""
    profiles = autoscaled(catalog)
    states = store.scale_states()
    forget = [key for key in states if key not in set(profiles)]
    if not profiles:
        if forget:
            store.write_scaling({}, {}, {}, HISTORY_MAX, forget)
        return snap, None
    specs = {(m.name, p.name): ScaleSpec.of(p) for m, p in catalog.profiles() if p.autoscale is not None}
    keep_since = {key: now - spec.horizon for key, spec in specs.items()}
    histories = {key: [Sample.from_list(row) for row in rows]
                 for key, rows in store.scale_histories(profiles, keep_since).items()}
    wanted = set(profiles)
    ids = [r.id for r in snap.replicas if (r.model, r.profile) in wanted]
    result: ScalePass = decide_all(catalog, snap.replicas, states, histories, store.gateway_reports(),
                                   store.loads(ids), store.demand_hints({m for m, _ in profiles}), now)
    store.write_scaling({(p.model, p.profile): p.state for p in result.profiles},
                        {(p.model, p.profile): (p.sample.t, p.sample.to_list()) for p in result.profiles},
                        keep_since, HISTORY_MAX, forget)
    for p in result.profiles:
        d = p.decision
        if not d.changed:
            continue
        log.info("autoscale %s/%s: %s", p.model, p.profile, d.reason)
        store.emit("replica_scaled", d.reason, source="control", model=p.model, profile=p.profile, ts=now,
                   before=d.current, after=d.count)
        if d.current == 0 and d.count > 0:
            store.emit("model_cold_start", d.reason, source="control", model=p.model, profile=p.profile, ts=now,
                       replicas=d.count)
    return replace(snap, wanted=result.counts, replica_load=result.replica_load), result.recheck_at
