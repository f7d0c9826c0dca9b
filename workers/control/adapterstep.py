"""The adapter step of a reconcile pass, as a shell: one read (the gateways' demand per adapter and
their hints), one decision (`adapterplan.decide_adapters`), the writes.

`adapter_step` runs between `plan` and applying its actions (new replicas are created with their
adapters); `apply_adapters` runs after: each runtime replica's new `adapters_wanted` (then its
agent is woken to load or unload), the llama.cpp replicas to replace with another set (rolled by
the next pass), the rows status and `llmgw explain` read, and an event when an adapter becomes short
of replicas or whole again.
"""

from __future__ import annotations

import logging

from llmgw.catalog import Catalog
from llmgw.state.kicks import PUBLISH, RECONCILE, Kicker
from llmgw.state.store import Store
from workers.control.adapterplan import AdapterDecision, AdapterRow, adapter_demand, decide_adapters
from workers.control.plan import Action
from workers.control.snapshot import Snapshot

log = logging.getLogger("llmgw.control.adapters")


def adapter_step(store: Store, catalog: Catalog, snap: Snapshot, actions: list[Action],
                 now: float) -> tuple[list[Action], AdapterDecision | None]:
    """The plan's actions with new replicas' adapters, and the decision (None: no catalog adapters)."""
    names = [a.name for m in catalog.models for a in m.adapters]
    if not names and not any(r.adapters_wanted for r in snap.replicas):
        return actions, None  # (replicas still told to hold a removed adapter are told to hold none)
    demand = adapter_demand(store.gateway_reports(), store.demand_hints(names), names, now)
    decision = decide_adapters(catalog, snap, actions, demand, now)
    return decision.with_adapters(actions), decision


def apply_adapters(store: Store, decision: AdapterDecision | None, now: float, kicker: Kicker | None = None) -> None:
    """Write what the step decided; one failure is logged and the rest goes on."""
    if decision is None:
        if store.adapter_rows()[0] is not None:
            store.write_adapter_rows([], now)  # the catalog has no adapters any more
        return
    for rid, adapters in decision.wanted.items():
        try:
            if store.update_replica(rid, adapters_wanted=list(adapters)):
                log.info("replica %s holds adapters %s from now on", rid, ", ".join(adapters) or "none")
                node = decision.nodes.get(rid)
                if node:
                    store.wake_agent(node, rid)
        except Exception:  # noqa: BLE001 - the next pass writes it again
            log.exception("replica %s: cannot write its adapters", rid)
    if decision.wanted and kicker is not None:
        kicker.kick(PUBLISH)  # an adapter no longer wanted somewhere is unpublished there at once
    for rid, adapters in decision.relaunch.items():
        try:
            if store.update_replica(rid, adapters_relaunch=list(adapters)):
                why = f"replaced to hold adapters {', '.join(adapters) or 'none'} (llama.cpp loads them at launch)"
                log.info("replica %s: %s", rid, why)
                store.emit("adapters_relaunch", why, source="control", replica=rid, ts=now,
                           adapters=list(adapters))
                if kicker is not None:
                    kicker.kick(RECONCILE)  # the next pass rolls it
        except Exception:  # noqa: BLE001
            log.exception("replica %s: cannot mark it for a relaunch with other adapters", rid)
    _rows(store, decision.rows, now)


def _rows(store: Store, rows: tuple[AdapterRow, ...], now: float) -> None:
    _at, before = store.adapter_rows()
    old = {}
    for d in before:
        try:
            row = AdapterRow.from_dict(d)
            old[(row.model, row.adapter)] = row
        except (KeyError, TypeError, ValueError):
            continue
    for row in rows:
        prev = old.get((row.model, row.adapter))
        if row.short and (prev is None or prev.reason != row.reason):
            store.emit("adapter_short", f"adapter {row.adapter} is on {row.placed} of {row.wanted or 'all'} replicas: "
                       f"{row.reason}", source="control", model=row.model, ts=now, adapter=row.adapter)
        elif not row.short and prev is not None and prev.short:
            store.emit("adapter_placed", f"adapter {row.adapter} is placed on {row.placed} replicas again",
                       source="control", model=row.model, ts=now, adapter=row.adapter)
    store.write_adapter_rows([r.to_dict() for r in rows], now)
