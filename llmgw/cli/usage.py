"""`llmgw usage`: tokens and requests per API key and model, as the gateways counted them."""

from __future__ import annotations

from llmgw.cli import common
from llmgw.state import keys
from llmgw.state.apikeys import ANONYMOUS, names_by_id


def read_usage(r) -> list[dict]:
    """Rows {key, id, model, prompt_tokens, completion_tokens, requests}, sorted by key then model."""
    names = names_by_id(r)
    ids = set(names) | {ANONYMOUS}
    prefix = keys.usage("")
    for k in r.scan_iter(match=prefix + "*", count=500):
        ids.add(k[len(prefix):])
    rows = []
    for kid in sorted(ids):
        h = r.hgetall(keys.usage(kid))
        per_model: dict[str, dict] = {}
        for field, value in h.items():
            model, _, kind = field.rpartition(":")
            row = per_model.setdefault(model, {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0})
            col = {"prompt": "prompt_tokens", "completion": "completion_tokens", "requests": "requests"}.get(kind)
            if col:
                row[col] = int(value)
        for model, row in sorted(per_model.items()):
            rows.append({"key": names.get(kid, kid + ("" if kid == ANONYMOUS else " (revoked)")),
                         "id": kid, "model": model, **row})
    return rows


def register(sub) -> None:
    p = sub.add_parser("usage", help="tokens and requests per API key and model")
    p.add_argument("--json", action="store_true")
    p.add_argument("--key", help="only this key (name or id)")
    p.set_defaults(func=_usage)


def _usage(args) -> int:
    from llmgw.cli.keys import redis_client

    rows = read_usage(redis_client())
    if args.key:
        rows = [r for r in rows if args.key in (r["key"], r["id"])]
    if args.json:
        common.print_json(rows)
        return 0
    if not rows:
        print("no usage recorded yet")
        return 0
    print(f"{'KEY':24} {'MODEL':28} {'REQUESTS':>9} {'PROMPT':>10} {'COMPLETION':>11}")
    for r in rows:
        print(f"{r['key']:24} {r['model']:28} {r['requests']:>9} {r['prompt_tokens']:>10} {r['completion_tokens']:>11}")
    return 0
