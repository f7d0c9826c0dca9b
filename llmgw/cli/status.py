"""`llmgw status [--json]`: nodes, replicas and the published endpoints, as the control plane sees them.

`build_status(...)` is pure (facts in, a JSON-able report out, every replica state derived with
`llmgw.state.replica_state.derive`); `render(...)` turns the report into the tables a human reads.
"""

from __future__ import annotations

import time
from typing import Collection, Iterable, Mapping

from llmgw.catalog import read_applied
from llmgw.cli.adapterview import adapter_rows
from llmgw.cli.adapterview import render as render_adapters
from llmgw.cli.common import print_json, settings, store
from llmgw.cli.fitview import fit_estimates
from llmgw.state.demand_records import GatewayReport, ScaleState
from llmgw.state.node_records import NodeAdmin, NodeInfo
from llmgw.state.records import ExternalRecord, LoadRecord, ReplicaRecord
from llmgw.state.replica_state import (
    State,
    derive,
    derive_external,
    download_failed,
    downloading,
    drain_progress,
    nodes_alive,
)
from llmgw.state.store import RedisError, Store


def register(sub) -> None:
    p = sub.add_parser("status", help="nodes, replicas and endpoints at a glance")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    report = gather_status(store(settings()), time.time())
    if args.json:
        print_json(report)
    else:
        print(render(report))
    return 0


def gather_status(s: Store, now: float) -> dict:
    """The facts `build_status` needs, read from Redis, and its report: what `llmgw status --json`
    prints (the console's fleet API serves the same)."""
    live = s.live_nodes()
    known = s.known_nodes() | set(live)
    admin = s.all_node_admin(sorted(known))
    replicas = s.all_replicas()
    version, _fp, endpoints = s.read_endpoints()
    catalog_problem, cat = None, None
    try:
        catalog_version, cat, meta = read_applied(s)
    except RedisError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. applied by a newer llmgw: report it, show the rest
        catalog_version = _raw_catalog_version(s)
        catalog_problem = str(e).splitlines()[0] if str(e) else type(e).__name__
    draining = [r.id for r in replicas if r.stop_requested_at is not None]
    bounds = {} if cat is None else {
        (m.name, p.name): (p.autoscale.min, p.autoscale.max) for m, p in cat.profiles() if p.autoscale}
    report = build_status(live, known, admin, replicas, version, len(endpoints), catalog_version, now,
                          listed={e.id for e in endpoints}, gateways=s.gateway_reports(),
                          loads=s.loads(draining), last_seen=s.nodes_last_seen(),
                          scaling=s.scale_states(), bounds=bounds, externals=s.external_records(),
                          estimates=fit_estimates(cat, s.weights_facts()),
                          adapters=s.adapter_rows()[1])
    if catalog_problem:
        report["catalog"]["problem"] = f"this llmgw cannot read it: {catalog_problem}"
    return report


def _raw_catalog_version(s) -> int | None:
    try:
        return s.catalog_version()
    except (ValueError, KeyError, TypeError):
        return None



# A heartbeat stamped this far in the future means the clocks disagree (a fresh one is never negative).
CLOCK_SKEW_WARN = 0.5


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def build_status(
    live: Mapping[str, NodeInfo],
    known: Iterable[str],
    admin: Mapping[str, NodeAdmin],
    replicas: Iterable[ReplicaRecord],
    endpoints_version: int,
    endpoints_count: int,
    catalog_version: int,
    now: float,
    *,
    listed: Collection[str] = (),
    gateways: Iterable[GatewayReport] = (),
    loads: Mapping[str, LoadRecord] | None = None,
    last_seen: Mapping[str, float] | None = None,
    scaling: Mapping[tuple[str, str], ScaleState] | None = None,
    bounds: Mapping[tuple[str, str], tuple[int, int]] | None = None,
    externals: Iterable[ExternalRecord] = (),
    estimates: Mapping[tuple[str, str], str] | None = None,
    adapters: Iterable[dict] = (),
) -> dict:
    """`listed`: ids in the published endpoint list (a Lost replica still in it shows as Ready, its
    node agent lost); `gateways` and `loads` tell how far a Draining replica's drain has come;
    `scaling` is the autoscaler's record per profile and `bounds` each autoscaled profile's (min, max);
    `externals`: the health-check records of external server urls; `estimates`: the fit estimate of
    each profile with a remote source ((model, profile) -> text, `llmgw.cli.fitview`); `adapters`: how the last reconcile pass placed each
    LoRA adapter (`Store.adapter_rows`)."""
    gateways = list(gateways)
    loads = loads or {}
    last_seen = last_seen or {}
    replicas = sorted(replicas, key=lambda r: (r.model, r.profile, r.id))
    used: dict[str, set[int]] = {}
    holder: dict[tuple[str, int], ReplicaRecord] = {}  # (node, GPU index) -> the replica holding it
    rows = []
    for rec in replicas:
        names = rec.all_nodes
        view = derive(rec, nodes_alive(rec, live), now)
        state, reason = view.state.value, view.reason
        if view.state is State.LOST and rec.id in listed and rec.stop_requested_at is None:
            gone = now - min((last_seen[n] for n in names if n not in live and n in last_seen), default=now)
            state, reason = State.READY.value, f"node agent lost {_age(gone)} ago; engine still serving"
        elif view.state is State.DRAINING:
            progress = drain_progress(rec, gateways, loads.get(rec.id), now)
            reason = f"{progress.inflight} in flight; {progress.note}; {view.reason}".rstrip("; ")
        if view.state is not State.STOPPED:
            for n, idxs in rec.gpus.items():
                used.setdefault(n, set()).update(idxs)
                holder.update(((n, i), rec) for i in idxs)
        rows.append({
            "id": rec.id,
            "model": rec.model,
            "profile": rec.profile,
            "node": rec.node,
            "nodes": list(names),
            "gpus": {n: list(ix) for n, ix in rec.gpus.items()},
            "state": state,
            "reason": reason,
            "restarts": rec.restarts,
            "age": now - rec.created_at if rec.created_at else None,
            "url": rec.url,
            "listed": rec.id in listed,  # in the published endpoint list: the gateways route to it
            "download": _download(rec),
            "fit": (estimates or {}).get((rec.model, rec.profile)),
            "engine_memory": rec.engine_memory,
        })
    nodes = []
    for name in sorted(set(known) | set(live)):
        info = live.get(name)
        flags = admin.get(name) or NodeAdmin()
        gpus: dict[str, dict[str, int]] = {}
        for g in info.gpus if info else ():
            entry = gpus.setdefault(g.gpu_class, {"total": 0, "used": 0, "free": 0})
            entry["total"] += 1
            if g.index in used.get(name, ()):
                entry["used"] += 1
            else:
                entry["free"] += 1
        nodes.append({
            "name": name,
            "live": info is not None,
            "pool": info.pool if info else None,
            "labels": dict(info.labels) if info else {},
            "address": info.address if info else None,
            "cordoned": flags.cordoned,
            "draining": flags.draining,
            "heartbeat_age": (now - info.heartbeat_at) if info and info.heartbeat_at else None,
            "gpus": gpus,
            # Each GPU and the replica holding it (None: free), for the console's row of boxes.
            "devices": [{"index": g.index, "class": g.gpu_class,
                         "replica": h.id if (h := holder.get((name, g.index))) else None,
                         "model": h.model if h else None, "healthy": g.healthy, "health": g.health}
                        for g in sorted(info.gpus if info else (), key=lambda g: g.index)],
            "replicas": sum(1 for r in rows if name in r["nodes"] and r["state"] != State.STOPPED.value),
            "weights": None if info is None or info.weights_free is None else {
                "dir": info.weights_dir, "free": info.weights_free, "room": info.weights_room,
                "budget": info.weights_budget, "sources": len(info.weights),
                "bytes": sum(w.size for w in info.weights)},
        })
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    autoscale = []
    for (model, profile), st in sorted((scaling or {}).items()):
        lo, hi = (bounds or {}).get((model, profile), (None, None))
        autoscale.append({
            "model": model, "profile": profile, "wanted": st.count, "min": lo, "max": hi,
            "replicas": sum(1 for r in rows if (r["model"], r["profile"]) == (model, profile)
                            and r["state"] not in (State.STOPPED.value, State.STOPPING.value, State.DRAINING.value)),
            "last_change": st.reason, "changed_at": st.since, "changed_age": now - st.since,
            "now": st.note,
        })
    external_rows = []
    for x in sorted(externals, key=lambda x: (x.model, x.profile, x.id)):
        view = derive_external(x)
        external_rows.append({"id": x.id, "model": x.model, "profile": x.profile, "url": x.url,
                              "state": view.state.value, "reason": view.reason, "listed": x.id in listed,
                              "checked_age": now - x.checked_at if x.checked_at else None})
    return {
        "catalog": {"version": catalog_version},
        "nodes": nodes,
        "replicas": rows,
        "externals": external_rows,
        "replica_states": counts,
        "autoscale": autoscale,
        "adapters": adapter_rows(adapters, replicas, now),
        "endpoints": {"version": endpoints_version, "count": endpoints_count},
        "estimates": [{"model": m, "profile": p, "fit": text} for (m, p), text in sorted((estimates or {}).items())],
        "time": now,
    }


def _download(rec: ReplicaRecord) -> dict | None:
    """A replica's download while it runs or after it failed: the figures the console draws a bar from."""
    if not (downloading(rec) or download_failed(rec)):
        return None
    return {"source": rec.weights_source, "phase": rec.weights_phase, "done": rec.weights_done,
            "total": rec.weights_total, "rate": rec.weights_rate, "eta": rec.weights_eta,
            "error_kind": rec.weights_error_kind if download_failed(rec) else None,
            "error": rec.weights_error if download_failed(rec) else None}


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(out)


def render(report: dict) -> str:
    node_rows = []
    for n in report["nodes"]:
        admin = "draining" if n["draining"] else ("cordoned" if n["cordoned"] else "-")
        gpus = ", ".join(f"{c} {g['used']}/{g['total']} used" for c, g in sorted(n["gpus"].items())) or "-"
        sick = [d for d in n["devices"] if not d.get("healthy", True)]
        if sick:
            gpus += " (" + ", ".join(f"GPU {d['index']} unhealthy: {d['health']}" for d in sick) + ")"
        node_rows.append([
            n["name"], n["pool"] or "?", "yes" if n["live"] else "NO", _age(n["heartbeat_age"]) if n["live"] else "gone",
            admin, gpus, str(n["replicas"]),
        ])
    rep_rows = []
    for r in report["replicas"]:
        gpus = "; ".join(f"{n}:{','.join(map(str, ix))}" for n, ix in r["gpus"].items()) or "-"
        rep_rows.append([
            r["id"], r["model"], r["profile"], ",".join(r["nodes"]) or "-", gpus, r["state"], str(r["restarts"]),
            _age(r["age"]), r["url"] or "-", r["reason"] or "",
        ])
    states = ", ".join(f"{v} {k}" for k, v in sorted(report["replica_states"].items())) or "none"
    ep = report["endpoints"]
    catalog = f"catalog version {report['catalog']['version']}"
    if report["catalog"]["version"] == 0:
        catalog = ("no catalog: the control plane places, stops and publishes nothing until one is applied "
                   "(`llmgw catalog apply FILE`)")
        if report["replicas"]:
            catalog += (f"\nwarning: Redis lost its data? {len(report['replicas'])} replica(s) run without a catalog "
                        "(their node agents registered them again) and the gateways route by their last list: "
                        "re-apply the catalog with `llmgw catalog apply FILE`")
    elif report["catalog"].get("problem"):
        catalog += f" ({report['catalog']['problem']}; the control plane keeps the last one it could read)"
    parts = [catalog]
    ahead = [n for n in report["nodes"] if n["live"] and n["heartbeat_age"] is not None
             and n["heartbeat_age"] < -CLOCK_SKEW_WARN]
    for n in ahead:
        parts.append(f"warning: node {n['name']}'s clock is {-n['heartbeat_age']:.1f}s ahead of this machine's; "
                     "llmgw needs synchronised clocks (NTP), see docs/control-plane.md")
    parts += [
        "",
        f"NODES ({len(node_rows)})",
        _table(["NAME", "POOL", "LIVE", "HEARTBEAT", "ADMIN", "GPUS", "REPLICAS"], node_rows) if node_rows
        else "  no node has sent a heartbeat",
        "",
        f"REPLICAS ({states})",
        _table(["ID", "MODEL", "PROFILE", "NODE", "GPUS", "STATE", "RESTARTS", "AGE", "URL", "REASON"], rep_rows)
        if rep_rows else "  none",
    ]
    if report.get("estimates"):
        parts += ["", "FIT ESTIMATES (from the weights' headers, per replica)"]
        for e in report["estimates"]:
            took = sorted({r["engine_memory"] for r in report["replicas"] if r.get("engine_memory")
                           and (r["model"], r["profile"]) == (e["model"], e["profile"])})
            parts.append(f"  {e['model']}/{e['profile']}: {e['fit']}" + (f"; the engine reports {'; '.join(took)}"
                                                                      if took else ""))
    if report.get("autoscale"):
        scale_rows = [[a["model"], a["profile"], str(a["wanted"]), "-" if a["min"] is None else str(a["min"]),
                       "-" if a["max"] is None else str(a["max"]), str(a["replicas"]), _age(a["changed_age"]) + " ago",
                       a["last_change"]] for a in report["autoscale"]]
        parts += ["", "AUTOSCALING",
                  _table(["MODEL", "PROFILE", "WANTED", "MIN", "MAX", "REPLICAS", "CHANGED", "LAST DECISION"],
                         scale_rows)]
    if report.get("externals"):
        ext_rows = [[x["id"], x["model"], x["profile"], x["url"], x["state"], _age(x["checked_age"]),
                     x["reason"] or ""] for x in report["externals"]]
        parts += ["", f"EXTERNAL SERVERS ({len(ext_rows)})",
                  _table(["ID", "MODEL", "PROFILE", "URL", "STATE", "CHECKED", "REASON"], ext_rows)]
    if report.get("adapters"):
        headers, ad_rows = render_adapters(report["adapters"])
        parts += ["", f"ADAPTERS ({len(ad_rows)})", _table(headers, ad_rows)]
    parts += [
        "",
        f"ENDPOINTS version {ep['version']}, {ep['count']} routable",
    ]
    return "\n".join(parts)
