"""`llmgw keys create|update|list|revoke`: API keys for the gateway (a thin shell over the store's keys).

A key is printed once, at creation; Redis keeps only its SHA-256 (`llmgw:apikeys` holds the records).
`update` changes a key's limits and policy (models, expiry, budget, weight, sub-tenants, admin, batches, an
isolated prefix cache), never the key itself.
Whether the gateway requires a key is `LLMGW_GATEWAY_AUTH` (see docs/gateway.md).
"""

from __future__ import annotations

import argparse
import sys
import time

from llmgw.cli import common
from llmgw.errors import RedisUnreachable
from llmgw.state.budget import BUDGET_PERIODS, iso
from llmgw.state.keypolicy import (  # noqa: F401 - hash_key: tests
    PRIORITIES,
    ApiKeyInvalid,
    ApiKeyRecord,
    hash_key,
    parse_expires,
    parse_models,
    parse_tokens,
    parse_weight,
)
from llmgw.state.store import RedisError, Store

CLEAR = ("none", "never", "all")  # the words that remove a limit or a policy in `update`


def checked_store() -> Store:
    """The CLI's store, its connection checked once so a dead Redis is one clear line, not a traceback."""
    s = common.settings()
    store = common.store(s)
    try:
        store.ping()
    except RedisError as e:
        raise RedisUnreachable(s.redis_url, e) from e
    return store


def _policy_flags(p: argparse.ArgumentParser, update: bool) -> None:
    clear = " ('none' removes it)" if update else ""
    p.add_argument("--rpm", help="requests per minute" + clear)
    p.add_argument("--tpm", help="tokens per minute (prompt + completion)" + clear)
    p.add_argument("--priority", choices=PRIORITIES + (("none",) if update else ()),
                   help="criticality of this key's requests, and the highest its X-LLMGW-Priority may claim")
    p.add_argument("--models", help="models (names or aliases) this key may call, comma-separated; others "
                                    "answer 404 as if they did not exist ('all': every model, the default)")
    p.add_argument("--expires", help="a duration (30d, 12h, 90m) or an ISO date or time (UTC unless it has an "
                                     "offset); then the key is refused" + (" ('never' removes it)" if update else ""))
    p.add_argument("--budget", help="tokens (prompt + completion) per budget period, e.g. 5M or 250k; past it "
                                    "429 until the period resets" + clear)
    p.add_argument("--budget-period", choices=BUDGET_PERIODS,
                   help="the UTC calendar day or month a budget counts (default: month)")
    p.add_argument("--weight", help="this key's share of a saturated model against the other keys' waiting for it "
                                    "(default 1; 2 = twice the service of a key of weight 1)")
    if update:
        p.add_argument("--sub-tenants", action=argparse.BooleanOptionalAction, default=None,
                       help="may (or may no longer) split its share among sub-tenants named in X-LLMGW-Tenant")
        p.add_argument("--admin", action=argparse.BooleanOptionalAction, default=None,
                       help="may (or may no longer) call the admin APIs")
    else:
        p.add_argument("--admin", action="store_true", help="may call the admin APIs (the console)")
        p.add_argument("--sub-tenants", action="store_true",
                       help="a trusted front end's key: may split its share among the sub-tenants it names in "
                            "X-LLMGW-Tenant")
    p.add_argument("--batches", action=argparse.BooleanOptionalAction, default=None,
                   help="may (the default) or may not use the Batch API (/v1/files, /v1/batches; docs/batch.md)")
    p.add_argument("--isolate-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="its requests carry a cache_salt of their own, so they share no prefix-cache entry with "
                        "other keys' on vLLM (default: off, prefixes are shared)")


def register(sub) -> None:
    p = sub.add_parser("keys", help="manage gateway API keys")
    ks = p.add_subparsers(dest="keys_command", metavar="ACTION")
    c = ks.add_parser("create", help="create a key and print it (once)")
    c.add_argument("name")
    _policy_flags(c, update=False)
    c.set_defaults(func=_create)
    u = ks.add_parser("update", help="change a key's limits or policy (the key itself stays)")
    u.add_argument("name", help="the key's name or id")
    _policy_flags(u, update=True)
    u.set_defaults(func=_update)
    ls = ks.add_parser("list", help="list keys (never the keys themselves)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)
    rv = ks.add_parser("revoke", help="revoke a key by name or id")
    rv.add_argument("name")
    rv.set_defaults(func=_revoke)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _count(text: str | None, flag: str) -> int | None:
    """An integer flag value (validated as positive with the record)."""
    if text is None or text.lower() in CLEAR:
        return None
    try:
        return int(text)
    except ValueError:
        raise ApiKeyInvalid(f"{flag}: expected an integer, got {text!r}") from None


def _changes(args, now: float) -> dict:
    """The fields the flags given set (`update`: only those; a CLEAR word sets None or nothing)."""
    out: dict = {}
    for flag, field in (("rpm", "rpm"), ("tpm", "tpm")):
        if getattr(args, flag) is not None:
            out[field] = _count(getattr(args, flag), f"--{flag}")
    if args.priority is not None:
        out["priority"] = None if args.priority == "none" else args.priority
    if args.models is not None:
        out["models"] = parse_models(args.models)
    if args.expires is not None:
        out["expires_at"] = None if args.expires.lower() in CLEAR else parse_expires(args.expires, now)
    if args.budget is not None:
        out["budget"] = None if args.budget.lower() in CLEAR else parse_tokens(args.budget)
    if args.budget_period is not None:
        out["budget_period"] = args.budget_period
    if args.admin is not None:
        out["admin"] = args.admin
    if args.batches is not None:
        out["batches"] = args.batches
    if args.weight is not None:
        out["weight"] = parse_weight(args.weight)
    if args.sub_tenants is not None:
        out["sub_tenants"] = args.sub_tenants
    if args.isolate_cache is not None:
        out["isolate_cache"] = args.isolate_cache
    return out


def _warn_unknown_models(store: Store, models) -> None:
    """A key may name a model before it is in the catalog; say so, in case it is a typo."""
    known = store.catalog_names()
    unknown = [m for m in models if m not in known]
    if unknown and known:
        print(f"note: {', '.join(unknown)} not in the applied catalog (yet); requests for it answer 404 until it is",
              file=sys.stderr)


def _create(args) -> int:
    store = checked_store()
    now = time.time()
    changes = _changes(args, now)
    rpm, tpm, priority = (changes.pop(f, None) for f in ("rpm", "tpm", "priority"))
    kid, key = common.replicated(lambda: store.create_key(args.name, rpm, tpm, priority, now=now, **changes))
    _warn_unknown_models(store, changes.get("models") or ())
    print(key)
    print(f"created key {args.name!r} (id {kid}); it is shown only now, store it safely", file=sys.stderr)
    return 0


def _update(args) -> int:
    store = checked_store()
    changes = _changes(args, time.time())
    if not changes:
        print("llmgw: nothing to change: give at least one of --rpm, --tpm, --priority, --models, --expires, "
              "--budget, --budget-period, --weight, --admin/--no-admin, --sub-tenants/--no-sub-tenants, "
              "--batches/--no-batches, --isolate-cache/--no-isolate-cache", file=sys.stderr)
        return 2
    rec = common.replicated(lambda: store.update_key(args.name, **changes))
    _warn_unknown_models(store, changes.get("models") or ())
    print(f"updated key {rec.name!r} (id {rec.id}): {_describe(rec)}; gateways apply it within their key "
          "refresh (LLMGW_GATEWAY_KEYS_INTERVAL)")
    return 0


def _describe(rec: ApiKeyRecord) -> str:
    parts = [f"models {','.join(rec.models) if rec.models else 'all'}",
             f"expires {iso(rec.expires_at) if rec.expires_at is not None else 'never'}",
             f"budget {f'{rec.budget} tokens per {rec.budget_period}' if rec.budget else 'none'}"]
    if rec.rpm or rec.tpm:
        parts.append(f"rpm {rec.rpm or '-'} tpm {rec.tpm or '-'}")
    if rec.priority:
        parts.append(f"priority {rec.priority}")
    parts.append(f"weight {rec.weight:g}")
    if rec.sub_tenants:
        parts.append("sub-tenants")
    if rec.admin:
        parts.append("admin")
    if not rec.batches:
        parts.append("no batches")
    if rec.isolate_cache:
        parts.append("isolated cache")
    return ", ".join(parts)


def _list(args) -> int:
    recs = checked_store().list_keys()
    if args.json:
        common.print_json([k.public() for k in recs])
        return 0
    if not recs:
        print("no API keys (with LLMGW_GATEWAY_AUTH=auto a gateway that never saw one accepts requests "
              "without a key; with =required it rejects them all)")
        return 0
    print(f"{'NAME':20} {'ID':12} {'RPM':>6} {'TPM':>8} {'PRIORITY':10} {'WEIGHT':>6} {'MODELS':20} "
          f"{'EXPIRES (UTC)':17} {'BUDGET':18} {'ADMIN':5} CREATED")
    for k in recs:
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(k.created_at or 0))
        expires = iso(k.expires_at)[:16].replace("T", " ") if k.expires_at is not None else "-"
        budget = f"{k.budget}/{k.budget_period}" if k.budget else "-"
        weight = f"{k.weight:g}" + ("+" if k.sub_tenants else "")  # +: it may name sub-tenants
        print(f"{k.name:20} {k.id:12} {str(k.rpm or '-'):>6} {str(k.tpm or '-'):>8} {k.priority or '-':10} "
              f"{weight:>6} {','.join(k.models) or 'all':20} {expires:17} {budget:18} {'yes' if k.admin else '-':5} "
              f"{created}")
    return 0


def _revoke(args) -> int:
    store = checked_store()
    kid = common.replicated(lambda: store.revoke_key(args.name))
    print(f"revoked {args.name} ({kid})")
    return 0
