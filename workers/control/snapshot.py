"""The facts one reconcile pass decides on, read from Redis in one call (`Store.fleet_view`).

`Snapshot` is plain data (frozen); `load_snapshot(store, now, reads)` is the only function here that
reads Redis, so `reconcile.decide`, `plan`, `place` and `endpoints_from` can be tested on hand-built
snapshots. `CatalogKeeper` turns the applied catalog's document into a `Catalog` and keeps the last
good one for the worker process.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, NamedTuple

from llmgw.catalog import Catalog, parse_applied
from llmgw.state.keys import ALL_MODELS
from llmgw.state.node_records import NodeAdmin, NodeInfo
from llmgw.state.records import ReplicaRecord
from llmgw.state.views import DemandReads, DemandView
from llmgw.state.weights import WeightsFacts

if TYPE_CHECKING:  # the decisions import Snapshot; only the shells hand a Store in
    from llmgw.state.store import Store

log = logging.getLogger("llmgw.control")


@dataclass(frozen=True)
class Snapshot:
    nodes: Mapping[str, NodeInfo]  # live nodes (heartbeat present), by name
    replicas: tuple[ReplicaRecord, ...] = ()
    admin: Mapping[str, NodeAdmin] = field(default_factory=dict)  # operator flags, by node name
    known: frozenset[str] = frozenset()  # every node that ever sent a heartbeat
    taken_at: float = 0.0
    last_seen: Mapping[str, float] = field(default_factory=dict)  # node -> time of its last heartbeat
    # Model (or keys.ALL_MODELS) -> how often its engine credentials were rotated.
    credentials: Mapping[str, int] = field(default_factory=dict)
    # Autoscaled profiles: (model, profile) -> the replica count the autoscaler wants (docs/autoscaling.md);
    # a profile not in it runs its catalog `replicas`. Decided, not read: the pass's autoscaling phase
    # (`reconcile.decide`) fills it in from `demand` before `plan` reads it.
    wanted: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # Requests each replica holds (gateways' in flight, or its engine's running + waiting if more), where
    # known: a scale-down stops the least loaded first, and preemption takes the least loaded victim.
    # Filled in with `wanted`.
    replica_load: Mapping[str, float] = field(default_factory=dict)
    # Remote sources -> their size and shape as a node agent read them (placement's disk and fit checks).
    weights: Mapping[str, WeightsFacts] = field(default_factory=dict)
    # The gateways' reports, the engines' loads, cold-start hints, the autoscaler's records and the last
    # adapter rows: what the autoscaling and adapter phases decide on (`reconcile.demand_reads` names them).
    demand: DemandView = DemandView()

    def credential_generation(self, model: str) -> int:
        """A replica of `model` made at a lower generation is outdated (rotated for all or for it)."""
        return self.credentials.get(ALL_MODELS, 0) + self.credentials.get(model, 0)


def load_snapshot(store: Store, now: float, reads: DemandReads = DemandReads()) -> Snapshot:
    """The fleet and the demand `reads` names, in one `Store.fleet_view`."""
    v = store.fleet_view(reads)
    return Snapshot(nodes=v.live, replicas=v.replicas, admin=v.admin, known=v.known, taken_at=now,
                    last_seen=v.last_seen, credentials=v.credentials, weights=v.weights, demand=v.demand)


class AppliedCatalog(NamedTuple):
    """The applied catalog as a pass reads it: its stored version, and the catalog."""

    version: int
    catalog: Catalog


# What the control plane says when Redis holds no catalog (the passes then do nothing).
NO_CATALOG = ("Redis holds no catalog (none was applied yet, or Redis lost its data): the control plane "
              "places, stops and publishes nothing until one is applied; running engines keep serving, "
              "their node agents register them again, and the gateways keep their last endpoint list. "
              "Apply the catalog: `llmgw catalog apply FILE`")


class CatalogKeeper:
    """The applied catalog as this process last read it successfully.

    A catalog this version cannot parse (written by a newer CLI, or damaged) must not stop the fleet:
    `load` then returns the last good catalog (or None when this process never read one, so the pass
    does nothing rather than act on an empty catalog) and logs the problem once per stored version.
    An unchanged document (same version and hash) is not validated again.

    No catalog at all is not an empty one either: Redis restarted without its data loses the catalog
    while the engines run on. `load` returns None then (the passes do nothing: no second set of
    engines, no empty endpoint list) and says so once, until a catalog is applied again."""

    def __init__(self) -> None:
        self.good: AppliedCatalog | None = None
        self._good_key: tuple | None = None
        self._bad_key: tuple | None = None
        self._missing = False

    def load(self, store: Store) -> AppliedCatalog | None:
        """`accept` of the applied document read now (a RedisError is not a catalog problem: raised)."""
        return self.accept(store.catalog_document())

    def accept(self, raw: str | None) -> AppliedCatalog | None:
        """The version and catalog of the applied document `raw` as stored (`Store.catalog_document`), or
        the last good one when it cannot be read; see the class doc."""
        key: tuple = ("unreadable",)
        try:
            if not raw:
                if not self._missing:
                    log.warning("%s", NO_CATALOG)
                self.good, self._good_key, self._missing = None, None, True
                return None
            self._missing = False
            doc = json.loads(raw)
            key = (doc.get("version"), doc.get("hash"))
            if key == self._good_key and self.good is not None:
                return self.good
            version, catalog, meta = parse_applied(raw)
            self.good = AppliedCatalog(version, catalog if catalog is not None else Catalog())
            self._good_key = (meta.get("version"), meta.get("hash"))
            self._bad_key = None
            return self.good
        except Exception as e:  # noqa: BLE001 - any unreadable document: keep serving the last good one
            if key != self._bad_key:
                self._bad_key = key
                kept = f"keeping version {self.good.version}" if self.good else "skipping passes until one is readable"
                log.error("applied catalog (version %s) cannot be read by this llmgw (%s); %s",
                          key[0], str(e).replace("\n", "; "), kept)
            return self.good
