"""What one control pass reads of Redis in one call (`Store.fleet_view`, `Store.publish_view`): plain
data, so the decisions over it are tested on hand-built views."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from llmgw.state.demand_records import GatewayReport
from llmgw.state.node_records import NodeAdmin, NodeInfo
from llmgw.state.records import ExternalRecord, ReplicaRecord
from llmgw.state.weights import WeightsFacts


@dataclass(frozen=True)
class FleetView:
    """The nodes and replica records, as the reconcile pass reads them."""

    known: frozenset[str] = frozenset()  # every node that ever sent a heartbeat
    live: Mapping[str, NodeInfo] = field(default_factory=dict)  # heartbeat present, by name
    replicas: tuple[ReplicaRecord, ...] = ()
    admin: Mapping[str, NodeAdmin] = field(default_factory=dict)  # operator flags of every known node
    last_seen: Mapping[str, float] = field(default_factory=dict)  # node -> time of its last heartbeat
    credentials: Mapping[str, int] = field(default_factory=dict)  # model or ALL_MODELS -> rotations
    weights: Mapping[str, WeightsFacts] = field(default_factory=dict)  # remote source -> its size and shape


@dataclass(frozen=True)
class PublishView:
    """What the publish pass decides on."""

    catalog: str | None = None  # the applied catalog document, as stored
    replicas: tuple[ReplicaRecord, ...] = ()
    live: Mapping[str, NodeInfo] = field(default_factory=dict)
    last_seen: Mapping[str, float] = field(default_factory=dict)
    gateways: tuple[GatewayReport, ...] = ()
    externals: tuple[ExternalRecord, ...] = ()
    version: int = 0  # the published list's version and fingerprint
    fingerprint: str = ""
