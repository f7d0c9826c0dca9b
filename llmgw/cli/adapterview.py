"""Where each LoRA adapter lives, for `llmgw status`, the console and `llmgw explain ADAPTER`. Pure.

`adapter_rows(placed, replicas, now)` joins how the last reconcile pass placed each adapter (the rows
it stores: wanted, placed, why short, demand) with the replica records' facts: which replicas hold
it now, which are loading it, which were told to hold it and do not yet, and each failed load with
its reason and next try. `render` is status's table; `explain_adapter` words one adapter.
"""

from __future__ import annotations

from typing import Iterable

from llmgw.state.records import ReplicaRecord


def adapter_rows(placed: Iterable[dict], replicas: Iterable[ReplicaRecord], now: float) -> list[dict]:
    recs = [r for r in replicas if r.stop_requested_at is None]
    out = []
    for p in sorted(placed, key=lambda p: (str(p.get("model")), str(p.get("adapter")))):
        name, model = str(p.get("adapter")), str(p.get("model"))
        mine = [r for r in recs if r.model == model]
        holders = [{"replica": r.id, "node": r.node} for r in mine if name in r.holds]
        loading = [r.id for r in mine if name in r.adapters_loading and r.adapters_attempt == r.attempt]
        waiting = [r.id for r in mine if name in r.adapters_wanted and name not in r.holds and r.id not in loading]
        failures = []
        for r in mine:
            f = (r.adapter_failures or {}).get(name)
            if isinstance(f, dict):
                retry = f.get("retry_at")
                failures.append({"replica": r.id, "reason": str(f.get("reason") or ""), "attempts": f.get("attempts"),
                                 "age": now - float(f.get("at") or now),
                                 "retry_in": None if retry is None else float(retry) - now})
        out.append({"adapter": name, "model": model, "wanted": p.get("wanted"), "placed": p.get("placed"),
                    "short": str(p.get("reason") or ""), "demand": float(p.get("demand") or 0.0),
                    "holders": holders, "loading": loading, "waiting": waiting, "failures": failures})
    return out


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return "due now" if seconds <= 0 else f"in {seconds:.0f}s"


def render(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Status's ADAPTERS table: headers and rows."""
    table = []
    for a in rows:
        held = ", ".join(f"{h['replica']}@{h['node']}" for h in a["holders"]) or "-"
        note = []
        if a["loading"]:
            note.append("loading on " + ", ".join(a["loading"]))
        if a["waiting"]:
            note.append("to load on " + ", ".join(a["waiting"]))
        for f in a["failures"]:
            note.append(f"failed on {f['replica']} ({f['attempts']}x, next try {_when(f['retry_in'])}): {f['reason']}")
        if a["short"]:
            note.append("short: " + a["short"])
        wanted = "all" if a["wanted"] is None else str(a["wanted"])
        table.append([a["adapter"], a["model"], wanted, str(len(a["holders"])), f"{a['demand']:g}", held,
                      "; ".join(note)])
    return ["ADAPTER", "MODEL", "WANTED", "HELD", "DEMAND", "WHERE", "NOTE"], table


def explain_adapter(row: dict, replicas: dict[str, dict]) -> tuple[bool, str]:
    """(whole, sentences) of one adapter's row; `replicas`: status's replica rows by id."""
    name, wanted = row["adapter"], row["wanted"]
    want = "every replica that serves it" if wanted is None else f"{wanted} replica(s) at least"
    lines = [f"Adapter {name} of model {row['model']}: wanted on {want}, held by {len(row['holders'])}"
             + (f", requests in flight or queued: {row['demand']:g}." if row["demand"] else ".")]
    for h in row["holders"]:
        lines.append(f"  {h['replica']} on {h['node']} holds it: requests for {name} are routed there.")
    for rid in row["loading"]:
        lines.append(f"  {rid} is loading it now.")
    for rid in row["waiting"]:
        state = replicas.get(rid, {}).get("state", "?")
        lines.append(f"  {rid} is told to hold it and does not yet (the replica is {state}; its agent loads it "
                     "once the engine is Ready).")
    for f in row["failures"]:
        lines.append(f"  Loading it on {f['replica']} failed {f['attempts']} time(s), the last {f['age']:.0f}s ago: "
                     f"{f['reason']}. Next try {_when(f['retry_in'])}.")
    if row["short"]:
        lines.append(f"  It is on fewer replicas than wanted: {row['short']}.")
    if not row["holders"]:
        lines.append(f"  No replica holds it: a request for {name} waits for one to load it while a replica of "
                     f"{row['model']} that serves it is Ready, else gets 503.")
    whole = bool(row["holders"]) and not row["short"]
    return whole, "\n".join(lines)
