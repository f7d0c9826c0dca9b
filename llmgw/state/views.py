"""What one control pass reads of Redis in one call (`Store.fleet_view`, `Store.publish_view`,
`Store.housekeeping_view`): plain
data, so the decisions over it are tested on hand-built views."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from llmgw.state.demand_records import DemandHint, GatewayReport, ScaleState
from llmgw.state.node_records import NodeAdmin, NodeInfo
from llmgw.state.records import ExternalRecord, LoadRecord, ReplicaRecord
from llmgw.state.weights import WeightsFacts


class AdapterRows(NamedTuple):
    """How the last reconcile pass placed each LoRA adapter (`keys.ADAPTERS`): when (None: no pass
    placed any, or the value is unreadable), and its rows as written
    (`workers.control.adapterplan.AdapterRow.to_dict`)."""

    at: float | None
    rows: list[dict]


@dataclass(frozen=True)
class DemandReads:
    """What a reconcile pass reads besides the fleet, named from its catalog
    (`workers.control.reconcile.demand_reads`): the store knows keys, not catalogs."""

    histories: Mapping[tuple[str, str], float] = field(default_factory=dict)  # autoscaled profile -> samples since
    loads: frozenset[tuple[str, str]] = frozenset()  # profiles whose replicas' last scrapes it reads
    hints: tuple[str, ...] = ()  # names (models, LoRA adapters) whose cold-start hints it reads
    gateways: bool = False  # the gateways' reports


@dataclass(frozen=True)
class DemandView:
    """What the gateways and the engines say of the work, and what the last reconcile pass wrote of
    its autoscaling and LoRA adapters: what the pass's autoscaling and adapter phases decide on."""

    gateways: tuple[GatewayReport, ...] = ()  # live gateway processes' reports
    loads: Mapping[str, LoadRecord] = field(default_factory=dict)  # replica -> its last scrape
    hints: Mapping[str, DemandHint] = field(default_factory=dict)  # model or adapter name -> cold-start hint
    scale_states: Mapping[tuple[str, str], ScaleState] = field(default_factory=dict)  # every profile's record
    histories: Mapping[tuple[str, str], tuple[list, ...]] = field(default_factory=dict)  # samples, oldest first
    adapter_rows: AdapterRows = AdapterRows(None, [])


@dataclass(frozen=True)
class FleetView:
    """The nodes and replica records, and the demand the catalog asked for, as the reconcile pass
    reads them."""

    known: frozenset[str] = frozenset()  # every node that ever sent a heartbeat
    live: Mapping[str, NodeInfo] = field(default_factory=dict)  # heartbeat present, by name
    replicas: tuple[ReplicaRecord, ...] = ()
    admin: Mapping[str, NodeAdmin] = field(default_factory=dict)  # operator flags of every known node
    last_seen: Mapping[str, float] = field(default_factory=dict)  # node -> time of its last heartbeat
    credentials: Mapping[str, int] = field(default_factory=dict)  # model or ALL_MODELS -> rotations
    weights: Mapping[str, WeightsFacts] = field(default_factory=dict)  # remote source -> its size and shape
    demand: DemandView = DemandView()


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


@dataclass(frozen=True)
class HousekeepingView:
    """What the housekeeping pass decides on."""

    replicas: tuple[ReplicaRecord, ...] = ()
    externals: tuple[ExternalRecord, ...] = ()
    known: frozenset[str] = frozenset()  # every node that ever sent a heartbeat
    live: Mapping[str, NodeInfo] = field(default_factory=dict)  # heartbeat present, by name
    admin: Mapping[str, NodeAdmin] = field(default_factory=dict)  # operator flags of every known node
    missing_since: Mapping[str, float] = field(default_factory=dict)  # node -> when first seen without a heartbeat
    last_seen: Mapping[str, float] = field(default_factory=dict)  # node -> time of its last heartbeat
