"""The housekeeping pass's shell: one read (`Store.housekeeping_view`), one decision
(`housekeeping.decide`), one write (`Store.write_housekeeping`), then the events of the nodes the
write found lost or back. The publish pass notices a lost or returned node sooner and notes it here
too (`note_nodes`)."""

from __future__ import annotations

import logging
from typing import AbstractSet, Mapping

from llmgw.state.store import Store
from workers.control.housekeeping import FORGET_AFTER, decide

log = logging.getLogger("llmgw.control")


def housekeeping_once(store: Store, now: float, forget_after: float = FORGET_AFTER) -> dict[str, int]:
    """Tidy what nobody else removes (`housekeeping.decide` says what). Returns how many stale load
    samples and nodes it removed."""
    view = store.housekeeping_view()
    d = decide(view, now, forget_after)
    done = store.write_housekeeping(d.keep_loads, d.index, d.nodes.gone, d.nodes.first_missing, d.nodes.back)
    announce_nodes(store, done.lost, done.returned, view.last_seen, now)
    if done.stale_loads or d.nodes.gone:
        log.info("housekeeping: %d stale load keys, forgot nodes %s", done.stale_loads, list(d.nodes.gone))
    return {"loads": done.stale_loads, "nodes": len(d.nodes.gone)}


def note_nodes(store: Store, first_missing: Mapping[str, float], back: AbstractSet[str] | tuple[str, ...],
               last_seen: Mapping[str, float], now: float) -> None:
    """Start (stop) the missing clock of nodes whose heartbeat expired (came back), and announce what
    this call changed (`announce_nodes`)."""
    lost, returned = store.note_missing_nodes(first_missing, back)
    announce_nodes(store, lost, returned, last_seen, now)


def announce_nodes(store: Store, lost: tuple[str, ...] | list[str], returned: tuple[str, ...] | list[str],
                   last_seen: Mapping[str, float], now: float) -> None:
    """Put each loss and return in the event history once: `lost` and `returned` are the nodes whose
    clock this process started or stopped (of several control workers noticing the same node, the
    store tells exactly one). `last_seen`: each node's last heartbeat, as the pass read it."""
    for n in lost:
        silent = f" for {now - last_seen[n]:.0f}s" if n in last_seen else ""
        store.emit("node_lost", f"no heartbeat{silent}; its replicas count as Lost", source="control", node=n, ts=now)
    for n in returned:
        store.emit("node_joined", "heartbeats again after it was lost", source="control", node=n, ts=now)
