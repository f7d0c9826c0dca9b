"""`llmgw keys create|update|list|revoke`: API keys for the gateway (a thin shell over the store's keys).
The console's keys page is the same shell in the browser: both read the flags' values with
`llmgw.state.keypolicy.key_changes` and write through the store's `create_key`, `update_key` and
`revoke_key`, which put each change in the event history (`key_created`, `key_updated`, `key_revoked`)
with who made it (here `user@host`; there the admin key).

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
    describe_key,
    hash_key,
    key_changes,
    unlisted_models,
)
from llmgw.state.store import RedisError, Store


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
    p.add_argument("--slo-ttft", help="its requests' default target for the first byte, from their arrival, e.g. "
                                      "500ms (their X-LLMGW-TTFT header wins; docs/gateway.md)" + clear)
    p.add_argument("--slo-tpot", help="its requests' default target per output token after the first, e.g. 80ms"
                                      + clear)
    p.add_argument("--slo-deadline", help="its requests' default target for the whole answer, e.g. 60s" + clear)
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


def _warn_unknown_models(store: Store, models) -> None:
    """A key may name a model before it is in the catalog; say so, in case it is a typo."""
    unknown = unlisted_models(models, store.catalog_names())
    if unknown:
        print(f"note: {', '.join(unknown)} not in the applied catalog (yet); requests for it answer 404 until it is",
              file=sys.stderr)


def _create(args) -> int:
    store = checked_store()
    now = time.time()
    changes = key_changes(vars(args), now)
    rpm, tpm, priority = (changes.pop(f, None) for f in ("rpm", "tpm", "priority"))
    kid, key = common.replicated(lambda: store.create_key(args.name, rpm, tpm, priority, now=now, by=common.who(),
                                                          **changes))
    _warn_unknown_models(store, changes.get("models") or ())
    print(key)
    print(f"created key {args.name!r} (id {kid}); it is shown only now, store it safely", file=sys.stderr)
    return 0


def _update(args) -> int:
    store = checked_store()
    changes = key_changes(vars(args), time.time())
    if not changes:
        print("llmgw: nothing to change: give at least one of --rpm, --tpm, --priority, --models, --expires, "
              "--budget, --budget-period, --weight, --slo-ttft, --slo-tpot, --slo-deadline, --admin/--no-admin, --sub-tenants/--no-sub-tenants, "
              "--batches/--no-batches, --isolate-cache/--no-isolate-cache", file=sys.stderr)
        return 2
    rec = common.replicated(lambda: store.update_key(args.name, by=common.who(), **changes))
    _warn_unknown_models(store, changes.get("models") or ())
    print(f"updated key {rec.name!r} (id {rec.id}): {describe_key(rec)}; gateways apply it within their key "
          "refresh (LLMGW_GATEWAY_KEYS_INTERVAL)")
    return 0


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
    kid = common.replicated(lambda: store.revoke_key(args.name, by=common.who()))
    print(f"revoked {args.name} ({kid})")
    return 0
