"""`llmgw explain MODEL`: in plain sentences, why a model has fewer Ready replicas than asked, or why its
requests are shed. `llmgw explain ADAPTER`: where a LoRA adapter is held, loading or failing, and why it
is on fewer replicas than wanted (llmgw.cli.adapterview). `llmgw explain REQUEST_ID`: how the gateway served
a request that asked to be explained (`X-LLMGW-Explain: 1`, as the console's playground does): the
replica, why it was picked, retries and resumed answers (llmgw.state.served).

Per replica: its state and why (a Pending one: the placement reason and why each live node refused it;
a crash loop: the exit and the last lines of the engine's log; a Lost one: since when its node is
silent); then the gateways' view (endpoints, load, requests in flight and queued, saturation).
`explain(...)` is pure: the facts in, the sentences and the verdict out. Exit 0 when every profile has
the replicas it asks for Ready, 1 otherwise.
"""

from __future__ import annotations

import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from llmgw.catalog import Catalog, read_applied
from llmgw.cli.adapterview import explain_adapter
from llmgw.cli.prefixview import prefix_sentence
from llmgw.cli.common import settings, store
from llmgw.cli.status import _age, gather_status
from llmgw.proc.exitstatus import describe_exit
from llmgw.state import events
from llmgw.state.demand_records import GatewayReport
from llmgw.state.records import EndpointInfo, LoadRecord, ReplicaRecord
from llmgw.state.replica_state import CrashPolicy, download_failed, recent_failures
from llmgw.state.served import SERVED_KEEP, recordable, sentences

LOG_LINES = 10  # of a failing engine's log
SATURATION_WINDOW = 600.0  # seconds of event history the gateways' saturation is read from


def register(sub) -> None:
    p = sub.add_parser("explain", help="why a model has fewer Ready replicas than asked, or sheds requests; "
                                       "where a LoRA adapter is loaded; how a request was served")
    p.add_argument("model", metavar="NAME", help="a model or LoRA adapter name (or alias) of the applied catalog, or "
                                                 "the X-Request-Id of a request sent with X-LLMGW-Explain: 1")
    p.add_argument("--request", action="store_true", help="NAME is a request id (else: one when no model or "
                                                          "adapter has that name)")
    p.set_defaults(func=cmd_explain)


@dataclass(frozen=True)
class Explanation:
    ok: bool  # every profile has the replicas it asks for Ready
    text: str


def cmd_explain(args) -> int:
    s = store(settings())
    now = time.time()
    _version, catalog, _meta = read_applied(s)
    named = catalog is not None and (catalog.resolve(args.model) or catalog.resolve_adapter(args.model))
    if args.request or not named:
        rec = s.served(args.model) if recordable(args.model) else None
        if rec is not None:
            print("\n".join(sentences(rec)))
            return 0
        if args.request:
            print(f"llmgw: no record of request {args.model!r}: a request is recorded when it is sent with "
                  f"X-LLMGW-Explain: 1, and kept {SERVED_KEEP // 60} minutes", file=sys.stderr)
            return 1
    report = gather_status(s, now)
    records = {r.id: r for r in s.all_replicas()}
    _v, _fp, endpoints = s.read_endpoints()
    model = catalog.resolve(args.model) if catalog else None
    recent = s.read_events(since=now - SATURATION_WINDOW, count=10_000)
    result = explain(args.model, catalog, report, records, endpoints, s.gateway_reports(),
                     s.loads([e.id for e in endpoints]), s.nodes_last_seen(),
                     events.matching(recent, model=model.name if model else args.model), now)
    print(result.text)
    return 0 if result.ok else 1


def explain(
    name: str,
    catalog: Catalog | None,
    report: dict,
    records: Mapping[str, ReplicaRecord],
    endpoints: Iterable[EndpointInfo],
    gateways: Iterable[GatewayReport],
    loads: Mapping[str, LoadRecord],
    last_seen: Mapping[str, float],
    history: Iterable[events.Event],
    now: float,
) -> Explanation:
    """`report`: `llmgw status`'s (`build_status`), whose derived states and reasons it words; `records`
    the replica records by id (pending refusals, exits, log tails); `history` this model's recent events."""
    model = catalog.resolve(name) if catalog else None
    found = catalog.resolve_adapter(name) if catalog and model is None else None
    if found is not None:
        return _adapter(found[1].name, report)
    if model is None:
        known = ", ".join(m.name for m in catalog.models) if catalog and catalog.models else "none"
        return Explanation(False, f"{name} is not a model or alias of the applied catalog (models: {known}).")
    rows = [r for r in report["replicas"] if r["model"] == model.name]
    out: list[str] = []
    ok = True
    wanted_total = ready_total = 0
    for profile in model.profiles:
        mine = [r for r in rows if r["profile"] == profile.name]
        ready = [r for r in mine if r["state"] == "Ready"]
        wanted_total += profile.replicas
        ready_total += min(len(ready), profile.replicas)
        ok = ok and len(ready) >= profile.replicas
        out.append(f"Profile {profile.name} ({profile.engine}): {profile.replicas} asked for, {len(ready)} Ready.")
        estimate = next((e["fit"] for e in report.get("estimates", ())
                         if (e["model"], e["profile"]) == (model.name, profile.name)), None)
        if estimate:
            out.append(_indent(f"Fit estimate from its weights' headers: {estimate}."))
        others = [r for r in mine if r["state"] not in ("Stopped",)]
        active = [r for r in others if not records.get(r["id"]) or records[r["id"]].stop_requested_at is None]
        if len(active) < profile.replicas:
            out.append(_indent(f"Only {len(active)} replica record(s) for {profile.replicas} asked: the control "
                               "plane has not created the rest yet (is a control worker running?)."))
        for r in others:
            out.append(_indent(_replica(r, records.get(r["id"]), report, last_seen, now)))
    gone = [r for r in rows if model.profile(r["profile"]) is None]
    if gone:
        out.append("Replicas of profiles no longer in the catalog:")
        out += [_indent(_replica(r, records.get(r["id"]), report, last_seen, now)) for r in gone]
    out += _gateways(model.name, list(endpoints), list(gateways), loads, list(history), now)
    head = f"{model.name}: {ready_total} of {wanted_total} replicas asked for are Ready" + (
        "." if ok else "; what is missing and why:")
    return Explanation(ok, "\n".join([head, *out]))


def _adapter(name: str, report: dict) -> Explanation:
    """`llmgw explain ADAPTER`: where it is held, loading, failing, and why it is short."""
    row = next((a for a in report.get("adapters") or () if a["adapter"] == name), None)
    if row is None:
        return Explanation(False, f"Adapter {name}: the control plane has not placed it yet (is a control worker "
                                  "running? it places adapters every reconcile pass).")
    ok, text = explain_adapter(row, {r["id"]: r for r in report["replicas"]})
    return Explanation(ok, text)


def _indent(text: str, by: str = "  ") -> str:
    return textwrap.indent(text, by)


def _on(row: dict) -> str:
    return f" on {','.join(row['nodes'])}" if row["nodes"] else ""


def _replica(row: dict, rec: ReplicaRecord | None, report: dict, last_seen: Mapping[str, float],
             now: float) -> str:
    rid, state, reason = row["id"], row["state"], row["reason"]
    if state == "Ready":
        extra = f" ({reason})" if reason else ""
        return f"{rid} is Ready{_on(row)}{extra}."
    if rec is None:
        return f"{rid} is {state}{_on(row)}: {reason}."
    if state == "Pending":
        return _pending(rid, rec, report, last_seen, now)
    if state == "Lost":
        silent = [f"{n} sends no heartbeat since {_age(now - last_seen[n])} ago" if n in last_seen
                  else f"{n} sends no heartbeat" for n in rec.all_nodes if not _live(report, n)]
        return (f"{rid} is Lost: node {'; node '.join(silent) or reason}. It is replaced on another node where "
                "there is room, and asked to stop once the replacement is Ready or the node stays gone.")
    if state in ("Failed", "CrashLoop") and download_failed(rec):
        return _download_failing(rid, row, rec, now)
    if state in ("Failed", "CrashLoop") or (state == "Starting" and _crash_looping(rec, now)):
        return _failing(rid, row, rec, now)
    if state == "Downloading":
        return (f"{rid} is Downloading{_on(row)} {rec.weights_source}: {reason}. Its engine starts once the weights "
                "are local; its start timeout counts from then.")
    if state == "Launching":
        placed = _age(now - (rec.launch_dispatched_at or rec.created_at))
        return (f"{rid} is Launching{_on(row)}: placed {placed} ago, waiting for the node agent to start it "
                f"(is the agent of {rec.node} running?).")
    if state == "Starting":
        probe = f"; last probe: {rec.probe_error}" if rec.probe_error else ""
        return (f"{rid} is Starting{_on(row)}: attempt {rec.attempt} started {_age(now - (rec.started_at or now))} "
                f"ago, not healthy yet{probe}.")
    if state == "Unhealthy":
        return (f"{rid} is Unhealthy{_on(row)}: its health probe fails ({rec.probe_error or 'no detail'}); the "
                "gateways do not route to it.")
    return f"{rid} is {state}{_on(row)}" + (f": {reason}." if reason else ".")


def _live(report: dict, node: str) -> bool:
    return any(n["name"] == node and n["live"] for n in report["nodes"])


def _pending(rid: str, rec: ReplicaRecord, report: dict, last_seen: Mapping[str, float], now: float) -> str:
    parts = [f"{rid} is Pending for {_age(now - rec.created_at)}: {rec.pending_reason or 'not placed yet'}."]
    considered = []
    for r in rec.pending_refusals:
        names = ", ".join(r.get("nodes") or [])
        more = r.get("count", 0) - len(r.get("nodes") or [])
        considered.append(f"{names}{f' and {more} more' if more > 0 else ''}: {r.get('why')}")
    if considered:
        parts.append("Nodes considered and why each was refused:")
        parts += [f"  - {c}" for c in considered]
    elif not any(n["live"] for n in report["nodes"]):
        parts.append("No node sends heartbeats: start a node agent (docs/agent.md).")
    silent = [n["name"] for n in report["nodes"] if not n["live"]]
    if silent:
        parts.append("Not considered (no heartbeat): " + ", ".join(
            f"{n} (last seen {_age(now - last_seen[n])} ago)" if n in last_seen else n for n in silent) + ".")
    return "\n".join(parts)


def _crash_looping(rec: ReplicaRecord, now: float) -> bool:
    """Failed often enough lately to be a crash loop, whatever the current attempt is doing: between two
    crashes the replica is Starting again, and that is still the crash loop to whoever asks why."""
    policy = CrashPolicy()
    return recent_failures(rec, now, policy) >= policy.max_failures


def _failing(rid: str, row: dict, rec: ReplicaRecord, now: float) -> str:
    if rec.running:  # a new attempt after the last exit
        how = (f"the last exit: {describe_exit(rec.exit_code, rec.exit_signal)}; attempt {rec.attempt} started "
               f"{_age(now - (rec.started_at or now))} ago, not healthy yet")
    else:
        how = f"attempt {rec.attempt} {describe_exit(rec.exit_code, rec.exit_signal)}"
    if row["state"] == "CrashLoop" or _crash_looping(rec, now):
        policy = CrashPolicy()
        text = (f"{rid} is in a crash loop{_on(row)}: {recent_failures(rec, now, policy)} unexpected exits in the "
                f"last {policy.window:g}s; {how}. The agent keeps retrying with a growing backoff; the control "
                "plane moves the replica when another node can take it.")
    else:
        text = f"{rid} Failed{_on(row)}: {how}."
    if rec.next_restart_at is not None and not rec.running:  # a running attempt is that start
        wait = rec.next_restart_at - now
        text += f" Next start {'in ' + _age(wait) if wait > 0 else 'due now'}."
    tail = [ln for ln in (rec.log_tail or "").splitlines() if ln.strip()][-LOG_LINES:]
    if tail:
        text += "\nThe last lines of its log (llmgw logs " + rid + "):\n" + "\n".join(f"    | {ln}" for ln in tail)
    return text


def _download_failing(rid: str, row: dict, rec: ReplicaRecord, now: float) -> str:
    """A replica whose weights could not be downloaded: the reason, and when the agent tries again."""
    why = f"the download of {rec.weights_source} failed ({rec.weights_error_kind}): {rec.weights_error}"
    if row["state"] == "CrashLoop":
        policy = CrashPolicy()
        text = (f"{rid} is in a crash loop{_on(row)}: {recent_failures(rec, now, policy)} failures in the last "
                f"{policy.window:g}s; {why}. The agent keeps retrying with a growing backoff; the control plane "
                "moves the replica when another node can take it.")
    else:
        text = f"{rid} Failed{_on(row)}: {why}."
    if rec.next_restart_at is not None:
        wait = rec.next_restart_at - now
        text += f" Next try {'in ' + _age(wait) if wait > 0 else 'due now'}."
    return text


def _gateways(model: str, endpoints: list[EndpointInfo], gateways: list[GatewayReport],
              loads: Mapping[str, LoadRecord], history: list[events.Event], now: float) -> list[str]:
    out = ["The gateways' view:"]
    mine = [e for e in endpoints if (e.model or (e.models[0] if e.models else "")) == model]
    if not mine:
        out.append(_indent(f"No endpoint of {model} is published: its requests get 503 (no Ready replica)."))
    else:
        out.append(_indent(f"{len(mine)} endpoint(s) published:"))
        for e in mine:
            inflight = sum(u.inflight for g in gateways if (u := g.endpoints.get(e.id)) is not None)
            load = loads.get(e.id)
            engine = "no load figures"
            if load is not None and load.ok:
                kv = f", KV {load.kv_usage:.0%}" if load.kv_usage is not None else ""
                engine = f"engine {_num(load.running)} running, {_num(load.waiting)} waiting{kv}"
            elif load is not None:
                engine = f"its metrics cannot be read: {load.error}"
            out.append(_indent(f"- {e.id} on {e.node or '?'}: {inflight} in flight from the gateways; {engine}", "    "))
            cache = prefix_sentence(e.id, gateways, load, e.kv_tokens)
            if cache:
                out.append(_indent(cache, "      "))
    demand = [g.models[model] for g in gateways if model in g.models]
    inflight = sum(d.inflight for d in demand)
    queued = sum(d.queued for d in demand)
    out.append(_indent(f"{len(gateways)} gateway process(es) report {inflight} request(s) in flight and {queued} "
                       f"queued for {model}."))
    if queued:
        out.append(_indent("Requests wait in the gateways' queues now: every endpoint is saturated (engine waiting "
                           "or KV use over the gateway's thresholds, or in-flight at capacity)."))
    marks = [e for e in history if e.kind in ("model_saturated", "model_recovered")]
    if not marks:
        out.append(_indent(f"No gateway reported {model} saturated in the last {SATURATION_WINDOW / 60:.0f} minutes."))
    for e in marks:
        word = "saturated" if e.kind == "model_saturated" else "recovered"
        out.append(_indent(f"{_age(now - e.ts)} ago {e.source or 'a gateway'} reported it {word}: {e.message}."))
    return out


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:g}"

