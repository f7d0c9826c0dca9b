"""What the console's API answers, built by pure functions over facts the blueprint read (docs/console.md).

The fleet page serves `llmgw status --json` as it is (`llmgw.cli.status.build_status`); the models page
adds, per model and profile, the replicas asked for, each replica's live load and the traffic charts;
the catalog page the applied document as YAML and its history.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from llmgw.catalog import Catalog, compact_yaml
from llmgw.cli.prefixview import index_size, prefix_ratios
from llmgw.state.demand_records import GatewayReport
from llmgw.state.records import LoadRecord

# Engine figures older than this (seconds) are shown as unknown, not as the engine's state now.
LOAD_FRESH_FOR = 10.0


def replica_load(rid: str, gateways: Iterable[GatewayReport], load: LoadRecord | None, unit: float | None,
                 now: float, declared_kv: int | None = None) -> dict:
    """One replica's live load: requests in flight from every gateway, the engine's own running,
    waiting and KV use (its last scrape, when fresh), and the service time this gateway learned."""
    inflight = sum(u.inflight for g in gateways if (u := g.endpoints.get(rid)) is not None)
    fresh = load is not None and load.ok and now - load.ts <= LOAD_FRESH_FOR
    gateways = list(gateways)
    expected, measured, _sent = prefix_ratios(rid, gateways, load)
    indexed, indexed_by = index_size(declared_kv, load)
    return {
        "inflight": inflight,
        "running": load.running if fresh else None,
        "waiting": load.waiting if fresh else None,
        "kv": load.kv_usage if fresh else None,
        "load_error": load.error if load is not None and not load.ok else None,
        "service_time": unit,
        # predicted vs measured prefix-cache hits (llmgw.cli.prefixview), None before any, and the
        # KV capacity the gateways' index of it is sized to, with where that figure comes from
        "prefix": {"expected": expected, "measured": measured, "indexed": indexed, "indexed_by": indexed_by}
        if expected is not None or measured is not None else None,
    }


def models_view(catalog: Catalog | None, report: dict, gateways: list[GatewayReport],
                loads: Mapping[str, LoadRecord], units: Mapping[str, float], traffic: Mapping[str, list[dict]],
                thresholds: dict, slot: float, now: float, tenants: list[dict] | None = None) -> dict:
    """Per model (the catalog's, then any whose records outlive it): replicas asked for and Ready per
    profile, each replica's row of `llmgw status` with its `load`, the gateways' demand, the
    traffic points (`gateway.observe.traffic.series`), and per API key what fair queueing counted
    (`tenants`: llmgw.state.tenants.service_rows)."""
    by_model: dict[str, list[dict]] = {}
    for row in tenants or ():
        by_model.setdefault(row["model"], []).append({k: v for k, v in row.items() if k != "model"})
    rows_by: dict[tuple[str, str], list[dict]] = {}
    declared = {(m.name, p.name): p.kv_cache_tokens for m in catalog.models for p in m.profiles} if catalog else {}
    for row in report["replicas"]:
        rows_by.setdefault((row["model"], row["profile"]), []).append(
            {**row, "load": replica_load(row["id"], gateways, loads.get(row["id"]), units.get(row["id"]), now,
                                         declared.get((row["model"], row["profile"])))})
    # model -> (aliases, in the catalog, [(profile, engine, replicas asked for, capacity)])
    shape: dict[str, tuple[list[str], bool, list[tuple]]] = {
        m.name: (list(m.aliases), True, [(p.name, p.engine, p.replicas, p.capacity) for p in m.profiles])
        for m in (catalog.models if catalog else [])}
    for model, profile in sorted(rows_by):  # records of what left the catalog, until they are gone
        _aliases, _in, profiles = shape.setdefault(model, ([], False, []))
        if all(p[0] != profile for p in profiles):
            profiles.append((profile, None, 0, None))
    models = []
    for name, (aliases, in_catalog, profiles) in shape.items():
        out_profiles = []
        for pname, engine, wanted, capacity in profiles:
            rows = rows_by.get((name, pname), [])
            out_profiles.append({"name": pname, "engine": engine, "wanted": wanted, "capacity": capacity,
                                 "ready": sum(1 for r in rows if r["state"] == "Ready"), "replicas": rows})
        demand = [g.models[name] for g in gateways if name in g.models]
        models.append({
            "name": name,
            "aliases": aliases,
            "in_catalog": in_catalog,
            "wanted": sum(p["wanted"] for p in out_profiles),
            "ready": sum(p["ready"] for p in out_profiles),
            "profiles": out_profiles,
            "gateway": {"inflight": sum(d.inflight for d in demand), "queued": sum(d.queued for d in demand),
                        "processes": len(gateways)},
            "traffic": traffic.get(name, []),
            # Its LoRA adapters: where each is held, loading or failing (llmgw.cli.adapterview).
            "adapters": [a for a in report.get("adapters") or () if a["model"] == name],
            # Fair queueing: each key's weight, service, share over the last minutes, mean queue wait.
            "tenants": by_model.get(name, []),
        })
    return {"time": now, "models": models, "thresholds": thresholds, "traffic_slot": slot}


def catalog_view(version: int, catalog: Catalog | None, meta: dict, history: list[dict]) -> dict:
    """The applied (or asked-for past) catalog: its metadata, its YAML as `llmgw catalog show -o yaml`
    prints it (defaults left out: a file to copy, edit and apply again), the history."""
    text = compact_yaml(catalog) if catalog else ""
    return {"version": version, "hash": meta.get("hash"), "applied_at": meta.get("applied_at"),
            "applied_by": meta.get("applied_by"), "source": meta.get("source"), "yaml": text, "history": history}
