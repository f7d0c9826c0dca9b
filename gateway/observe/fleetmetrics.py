"""The control plane's metrics, for Prometheus: `GET /metrics/fleet` on every gateway (docs/monitoring.md).

Why the gateway and not a `/metrics` port in the control worker: every figure is a fact in Redis (the
replica records, heartbeats, the endpoint list, the control passes' counters `Store.control_stats`), so
any process can compute them; the gateway already serves HTTP on a port Prometheus scrapes, while a
control worker is a Celery process (several per fleet, often on one host) with no port of its own.
Every gateway answers the same figures: scrape one, or aggregate with `max`, never `sum`.

`fleet_families(fleet)` is pure: the facts in, the metric families out. FAMILIES names them all (the
dashboard test reads it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.observe.fleet import Fleet

# name -> (type, help, labels)
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llmgw_fleet_replicas": ("gauge", "Replicas by model, profile and state (llmgw status)", ("model", "profile", "state")),
    "llmgw_fleet_replicas_wanted": ("gauge", "Replicas the applied catalog asks for", ("model", "profile")),
    "llmgw_fleet_pending_replicas": ("gauge", "Replicas no node could take yet", ()),
    "llmgw_fleet_replica_restarts": ("gauge", "Engine restarts of the current replicas", ("model", "profile")),
    "llmgw_fleet_nodes": ("gauge", "Nodes by heartbeat: live, or lost (known, no heartbeat)", ("state",)),
    "llmgw_fleet_nodes_unschedulable": ("gauge", "Nodes that take nothing new: cordoned or draining", ("reason",)),
    "llmgw_fleet_gpus": ("gauge", "GPUs of live nodes by class, used or free", ("gpu_class", "state")),
    "llmgw_fleet_endpoints": ("gauge", "Endpoints in the published list", ()),
    "llmgw_fleet_endpoints_version": ("gauge", "Version of the published endpoint list", ()),
    "llmgw_fleet_catalog_version": ("gauge", "Version of the applied catalog", ()),
    "llmgw_control_passes": ("counter", "Control passes run, by task (reconcile, publish)", ("task",)),
    "llmgw_control_pass_seconds": ("counter", "Seconds spent in control passes, by task", ("task",)),
    "llmgw_control_actions": ("counter", "Actions applied by control passes, by task (reconcile: creates, "
                                         "stops, placements ...; publish: new lists)", ("task",)),
}
CONTROL_TASKS = ("reconcile", "publish")


def _family(name: str) -> Metric:
    kind, text, labels = FAMILIES[name]
    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
    return cls(name, text, labels=list(labels))


def fleet_families(fleet: Fleet) -> list[Metric]:
    report = fleet.report
    fam = {name: _family(name) for name in FAMILIES}
    by_state: dict[tuple[str, str, str], int] = {}
    restarts: dict[tuple[str, str], int] = {}
    for r in report["replicas"]:
        key = (r["model"], r["profile"])
        by_state[(*key, r["state"])] = by_state.get((*key, r["state"]), 0) + 1
        restarts[key] = restarts.get(key, 0) + (r["restarts"] or 0)
    for labels, n in sorted(by_state.items()):
        fam["llmgw_fleet_replicas"].add_metric(list(labels), n)
    for m in fleet.catalog.models if fleet.catalog else []:
        for p in m.profiles:
            fam["llmgw_fleet_replicas_wanted"].add_metric([m.name, p.name], p.replicas)
    for labels, n in sorted(restarts.items()):
        fam["llmgw_fleet_replica_restarts"].add_metric(list(labels), n)
    fam["llmgw_fleet_pending_replicas"].add_metric([], report["replica_states"].get("Pending", 0))
    nodes = report["nodes"]
    fam["llmgw_fleet_nodes"].add_metric(["live"], sum(1 for n in nodes if n["live"]))
    fam["llmgw_fleet_nodes"].add_metric(["lost"], sum(1 for n in nodes if not n["live"]))
    fam["llmgw_fleet_nodes_unschedulable"].add_metric(["cordoned"], sum(1 for n in nodes if n["cordoned"] and not n["draining"]))
    fam["llmgw_fleet_nodes_unschedulable"].add_metric(["draining"], sum(1 for n in nodes if n["draining"]))
    gpus: dict[tuple[str, str], int] = {}
    for n in nodes:
        for cls_, g in n["gpus"].items():
            gpus[(cls_, "used")] = gpus.get((cls_, "used"), 0) + g["used"]
            gpus[(cls_, "free")] = gpus.get((cls_, "free"), 0) + g["free"]
    for labels, n in sorted(gpus.items()):
        fam["llmgw_fleet_gpus"].add_metric(list(labels), n)
    fam["llmgw_fleet_endpoints"].add_metric([], report["endpoints"]["count"])
    fam["llmgw_fleet_endpoints_version"].add_metric([], report["endpoints"]["version"])
    fam["llmgw_fleet_catalog_version"].add_metric([], report["catalog"]["version"] or 0)
    for task in CONTROL_TASKS:
        fam["llmgw_control_passes"].add_metric([task], fleet.control.get(f"{task}:passes", 0.0))
        fam["llmgw_control_pass_seconds"].add_metric([task], fleet.control.get(f"{task}:seconds", 0.0))
        fam["llmgw_control_actions"].add_metric([task], fleet.control.get(f"{task}:actions", 0.0))
    return list(fam.values())


class _Collector:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def render(fleet: Fleet) -> bytes:
    """The Prometheus text exposition of `fleet_families`."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(fleet_families(fleet)))
    return generate_latest(reg)
