"""One-time migrations of what an older release left in Redis, run at the start of each reconcile pass
until done, outside the pure cores.

Each knows whether it is done (a mark in Redis, so it runs again after Redis lost its data, when
there is again something to migrate) and is idempotent: two control workers running one at once
do no harm. A failure is logged and retried next pass; what it migrates keeps working meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

from llmgw.state.store import Store

log = logging.getLogger("llmgw.control")


@dataclass(frozen=True)
class Migration:
    name: str
    done: Callable[[Store], bool]
    run: Callable[[Store], None]
    meanwhile: str  # what keeps working until it succeeds, for the log


def _index_replica_nodes(store: Store) -> None:
    store.reindex_replica_nodes(store.all_replicas())


MIGRATIONS: tuple[Migration, ...] = (
    # Records written before the per-node replica index existed are indexed, then the index is marked
    # complete (`keys.REPLICA_NODE_INDEX_READY`).
    Migration("the per-node replica index", Store.replica_node_index_ready, _index_replica_nodes,
              "the agents scan every record: slower, not wrong"),
)


def run_pending(store: Store, migrations: Iterable[Migration] = MIGRATIONS) -> list[str]:
    """Run each migration not done yet; returns the names of those that ran and succeeded. Never raises."""
    ran = []
    for m in migrations:
        try:
            if m.done(store):
                continue
            m.run(store)
            ran.append(m.name)
            log.info("migrated %s", m.name)
        except Exception:  # noqa: BLE001 - retried next pass; the pass itself goes on
            log.exception("migrating %s failed; retried next pass (meanwhile %s)", m.name, m.meanwhile)
    return ran
