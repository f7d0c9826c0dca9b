"""The facts one control pass decides on, read from Redis in a few round trips.

`Snapshot` is plain data (frozen); `load_snapshot(store, now)` is the only function here that talks to
Redis, so `plan`, `place` and `endpoints_from` can be tested on hand-built snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from llmgw.catalog import Catalog
from llmgw.catalog_store import read_applied
from llmgw.records import NodeAdmin, NodeInfo, ReplicaRecord
from llmgw.store import Store


@dataclass(frozen=True)
class Snapshot:
    nodes: Mapping[str, NodeInfo]  # live nodes (heartbeat present), by name
    replicas: tuple[ReplicaRecord, ...] = ()
    admin: Mapping[str, NodeAdmin] = field(default_factory=dict)  # operator flags, by node name
    known: frozenset[str] = frozenset()  # every node that ever sent a heartbeat
    taken_at: float = 0.0

    def node_alive(self, rec: ReplicaRecord) -> bool:
        """A replica's nodes are all live (a multi-node replica is lost with any of its nodes)."""
        names = rec.nodes or ([rec.node] if rec.node else [])
        return all(n in self.nodes for n in names)


def load_snapshot(store: Store, now: float) -> Snapshot:
    known = store.known_nodes()
    live = store.live_nodes()
    names = sorted(known | set(live))
    return Snapshot(
        nodes=live,
        replicas=tuple(store.all_replicas()),
        admin=store.all_node_admin(names),
        known=frozenset(names),
        taken_at=now,
    )


def load_catalog(store: Store) -> tuple[int, Catalog]:
    """The applied catalog; an empty one (version 0) when nothing was ever applied."""
    version, catalog, _meta = read_applied(store.r)
    return version, catalog if catalog is not None else Catalog()
