"""`llmgw keys create|list|revoke`: API keys for the gateway.

A key is printed once, at creation; Redis keeps only its SHA-256 (`llmgw:apikeys` holds the records,
`llmgw:apikey:<hash>` maps a hash to its id). Once any key exists the gateway requires one.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
import time

from llmgw import keys
from llmgw.cli import common
from llmgw.errors import LlmgwError, NotFound

PRIORITIES = ("critical", "standard", "sheddable")


class KeyError_(LlmgwError):
    """A bad argument to `llmgw keys`."""


class RedisUnreachable(LlmgwError):
    def __init__(self, url: str, err: Exception):
        super().__init__(f"cannot reach Redis at {url}: {err} (set LLMGW_REDIS_URL)")


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


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(r, name: str, rpm: int | None = None, tpm: int | None = None,
               priority: str | None = None, now: float | None = None) -> tuple[str, str]:
    """Store a new key; returns (key id, the key itself). Names are unique among live keys."""
    if not name or len(name) > 100:
        raise KeyError_("NAME: must be 1..100 characters")
    for v, flag in ((rpm, "--rpm"), (tpm, "--tpm")):
        if v is not None and v <= 0:
            raise KeyError_(f"{flag}: must be a positive integer, got {v}")
    if priority is not None and priority not in PRIORITIES:
        raise KeyError_(f"--priority: expected one of {', '.join(PRIORITIES)}, got {priority!r}")
    if any(json.loads(v).get("name") == name for v in r.hvals(keys.API_KEYS)):
        raise KeyError_(f"a key named {name!r} already exists (revoke it first)")
    key_id = "k-" + secrets.token_hex(4)
    key = "sk-llmgw-" + secrets.token_urlsafe(32)
    h = hash_key(key)
    rec = {"name": name, "hash": h, "rpm": rpm, "tpm": tpm, "priority": priority,
           "created_at": time.time() if now is None else now}
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.API_KEYS, key_id, json.dumps(rec))
    pipe.set(keys.api_key_by_hash(h), key_id)
    pipe.execute()
    return key_id, key


def list_keys(r) -> list[dict]:
    out = []
    for kid, blob in sorted(r.hgetall(keys.API_KEYS).items()):
        d = json.loads(blob)
        d.pop("hash", None)
        out.append({"id": kid, **d})
    return sorted(out, key=lambda d: d.get("name", ""))


def revoke_key(r, name_or_id: str) -> str:
    for kid, blob in r.hgetall(keys.API_KEYS).items():
        d = json.loads(blob)
        if name_or_id in (kid, d.get("name")):
            pipe = r.pipeline(transaction=True)
            pipe.hdel(keys.API_KEYS, kid)
            pipe.delete(keys.api_key_by_hash(d.get("hash", "")))
            pipe.execute()
            return kid
    raise NotFound("API key", name_or_id)


def register(sub) -> None:
    p = sub.add_parser("keys", help="manage gateway API keys")
    ks = p.add_subparsers(dest="keys_command", metavar="ACTION")
    c = ks.add_parser("create", help="create a key and print it (once)")
    c.add_argument("name")
    c.add_argument("--rpm", type=int, help="requests per minute")
    c.add_argument("--tpm", type=int, help="tokens per minute (prompt + completion)")
    c.add_argument("--priority", choices=PRIORITIES, help="default criticality of this key's requests")
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
    rows = list_keys(redis_client())
    if args.json:
        common.print_json(rows)
        return 0
    if not rows:
        print("no API keys: the gateway accepts requests without one")
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
