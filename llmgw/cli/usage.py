"""`llmgw usage`: tokens and requests per API key and model (and the goodput of its requests that had
latency targets: the share that met them, llmgw.slo), the budgets of keys that have one
(tokens spent this UTC day or month, and what remains), and what fair queueing counted per key and
model (its weight, the service it received, its share lately, its requests' mean wait in the queue),
as the gateways flushed them."""

from __future__ import annotations

from llmgw.cli import common
from llmgw.state.keypolicy import ANONYMOUS, usage_by_model
from llmgw.state.store import Store
from llmgw.state.tenants import SHARE_MINUTES, service_rows


def read_usage(store: Store) -> list[dict]:
    """Rows {key, id, model, prompt_tokens, completion_tokens, requests}, and {slo_requests, slo_met} where
    some had latency targets, sorted by key then model."""
    names = store.key_names()
    rows = []
    for kid, raw in sorted(store.all_key_usage({*names, ANONYMOUS}).items()):
        for model, row in sorted(usage_by_model(raw).items()):
            rows.append({"key": names.get(kid, kid + ("" if kid == ANONYMOUS else " (revoked)")),
                         "id": kid, "model": model, **row})
    return rows


def read_service(store: Store, now: float) -> list[dict]:
    """What fair queueing counted per key and model (llmgw.state.tenants.service_rows)."""
    totals = store.tenant_totals()
    minute = int(now // 60)
    recent = store.tenant_minutes(list(totals), range(minute - SHARE_MINUTES + 1, minute + 1))
    return service_rows({k.id: k for k in store.list_keys()}, totals, recent)


def goodput(row: dict) -> str:
    """`99.2% of 1250`: the share of a key's requests with latency targets that met them (met / all, the
    refused early included); `-` when none had targets."""
    n = row.get("slo_requests", 0)
    return f"{100 * row.get('slo_met', 0) / n:.1f}% of {n}" if n else "-"


def register(sub) -> None:
    p = sub.add_parser("usage", help="tokens and requests per API key and model; budgets and what remains")
    p.add_argument("--json", action="store_true", help='{"usage": [rows], "budgets": [rows], "service": [rows]}')
    p.add_argument("--key", help="only this key (name or id)")
    p.set_defaults(func=_usage)


def _usage(args) -> int:
    import time

    from llmgw.cli.keys import checked_store

    store = checked_store()
    now = time.time()
    rows, budgets, service = read_usage(store), store.key_budgets(now), read_service(store, now)
    if args.key:
        rows = [u for u in rows if args.key in (u["key"], u["id"])]
        budgets = [b for b in budgets if args.key in (b["key"], b["id"])]
        service = [s for s in service if args.key in (s["key"], s["id"])]
    if args.json:
        common.print_json({"usage": rows, "budgets": budgets, "service": service})
        return 0
    if not rows:
        print("no usage recorded yet")
    else:
        print(f"{'KEY':24} {'MODEL':28} {'REQUESTS':>9} {'PROMPT':>10} {'COMPLETION':>11} {'GOODPUT':>17}")
        for u in rows:
            print(f"{u['key']:24} {u['model']:28} {u['requests']:>9} {u['prompt_tokens']:>10} "
                  f"{u['completion_tokens']:>11} {goodput(u):>17}")
    if budgets:
        print(f"\n{'KEY':24} {'PERIOD':12} {'USED':>12} {'BUDGET':>12} {'REMAINING':>12} RESETS (UTC)")
        for b in budgets:
            print(f"{b['key']:24} {b['period_id']:12} {b['used']:>12} {b['tokens']:>12} {b['remaining']:>12} "
                  f"{b['resets_at']}")
    if service:
        print(f"\n{'KEY':24} {'MODEL':28} {'WEIGHT':>6} {'SERVICE':>12} {'SHARE 5m':>9} {'MEAN WAIT':>10}")
        for r in service:
            share = f"{100 * r['share']:.1f}%" if r["share"] is not None else "-"
            wait = f"{r['mean_wait']:.3f}s" if r["mean_wait"] is not None else "-"
            print(f"{r['key']:24} {r['model']:28} {r['weight']:>6g} {r['service_tokens']:>12} {share:>9} {wait:>10}")
    return 0
