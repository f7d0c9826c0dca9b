"""`llmgw keys create|list|revoke`: API keys for the gateway (a thin shell over `llmgw.state.apikeys`).

A key is printed once, at creation; Redis keeps only its SHA-256 (`llmgw:apikeys` holds the records).
Whether the gateway requires a key is `LLMGW_GATEWAY_AUTH` (see docs/gateway.md).
"""

from __future__ import annotations

import sys
import time

from llmgw.cli import common
from llmgw.errors import RedisUnreachable
from llmgw.state.apikeys import PRIORITIES, create_key, hash_key, list_keys, revoke_key  # noqa: F401 - hash_key: tests


def redis_client():
    """The CLI's Redis connection, checked once so a dead Redis is one clear line, not a traceback."""
    import redis

    s = common.settings()
    r = common.store(s).r
    try:
        r.ping()
    except redis.RedisError as e:
        raise RedisUnreachable(s.redis_url, e) from e
    return r


def register(sub) -> None:
    p = sub.add_parser("keys", help="manage gateway API keys")
    ks = p.add_subparsers(dest="keys_command", metavar="ACTION")
    c = ks.add_parser("create", help="create a key and print it (once)")
    c.add_argument("name")
    c.add_argument("--rpm", type=int, help="requests per minute")
    c.add_argument("--tpm", type=int, help="tokens per minute (prompt + completion)")
    c.add_argument("--priority", choices=PRIORITIES,
                   help="criticality of this key's requests, and the highest its X-LLMGW-Priority may claim")
    c.set_defaults(func=_create)
    ls = ks.add_parser("list", help="list keys (never the keys themselves)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)
    rv = ks.add_parser("revoke", help="revoke a key by name or id")
    rv.add_argument("name")
    rv.set_defaults(func=_revoke)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _create(args) -> int:
    kid, key = create_key(redis_client(), args.name, args.rpm, args.tpm, args.priority)
    print(key)
    print(f"created key {args.name!r} (id {kid}); it is shown only now, store it safely", file=sys.stderr)
    return 0


def _list(args) -> int:
    rows = [k.public() for k in list_keys(redis_client())]
    if args.json:
        common.print_json(rows)
        return 0
    if not rows:
        print("no API keys (with LLMGW_GATEWAY_AUTH=auto a gateway that never saw one accepts requests "
              "without a key; with =required it rejects them all)")
        return 0
    print(f"{'NAME':20} {'ID':12} {'RPM':>8} {'TPM':>10} {'PRIORITY':10} CREATED")
    for d in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(d.get("created_at") or 0))
        print(f"{d.get('name', ''):20} {d['id']:12} {str(d.get('rpm') or '-'):>8} "
              f"{str(d.get('tpm') or '-'):>10} {d.get('priority') or '-':10} {created}")
    return 0


def _revoke(args) -> int:
    kid = revoke_key(redis_client(), args.name)
    print(f"revoked {args.name} ({kid})")
    return 0
