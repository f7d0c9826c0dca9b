"""Gateway API keys: the record type, pure helpers, and the Redis functions the CLI and gateway share.

A key is shown once, at creation; Redis keeps only its SHA-256, in the `keys.API_KEYS` hash
(key id -> JSON record). The gateway caches the whole hash in memory, so it needs no by-hash index:
`keys.api_key_by_hash` is no longer written, and only deleted on revoke (records made by older
versions had one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import typing
from dataclasses import asdict, dataclass
from typing import Callable, Literal

from llmgw.errors import LlmgwError, NotFound
from llmgw.state import keys

log = logging.getLogger("llmgw.state.apikeys")

Priority = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[str, ...] = typing.get_args(Priority)
PRIORITY_RANK = {"sheddable": 0, "standard": 1, "critical": 2}
KEY_PREFIX = "sk-llmgw-"
# The key id under which gateways count usage of requests served while no key was required.
ANONYMOUS = "anonymous"


class ApiKeyInvalid(LlmgwError):
    """A bad argument for a new API key (names the flag and the reason)."""


@dataclass(frozen=True)
class ApiKeyRecord:
    """One stored key: never the key itself, only its hash."""

    id: str
    name: str
    hash: str = ""
    rpm: int | None = None
    tpm: int | None = None
    priority: str | None = None  # the highest criticality this key's requests may claim
    created_at: float = 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("id")
        return json.dumps(d)

    @classmethod
    def from_json(cls, key_id: str, blob: str) -> "ApiKeyRecord":
        """Raises ValueError on a malformed record."""
        try:
            d = json.loads(blob)
            if not isinstance(d, dict) or not isinstance(d.get("hash"), str):
                raise ValueError("no 'hash'")
            prio = d.get("priority")
            if prio is not None and prio not in PRIORITIES:
                raise ValueError(f"bad priority {prio!r}")
            return cls(id=key_id, name=str(d.get("name") or key_id), hash=d["hash"],
                       rpm=_pos_int(d.get("rpm")), tpm=_pos_int(d.get("tpm")), priority=prio,
                       created_at=float(d.get("created_at") or 0.0))
        except (TypeError, ValueError) as e:
            raise ValueError(f"API key record {key_id}: {e}") from None

    def public(self) -> dict:
        """What `llmgw keys list` shows: everything but the hash."""
        d = asdict(self)
        d.pop("hash")
        return d


def _pos_int(v) -> int | None:
    return None if v is None else int(v)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def cap_priority(requested: str, ceiling: str) -> str:
    """The lower of two criticalities: a key's requests can lower their priority, never raise it."""
    return requested if PRIORITY_RANK[requested] <= PRIORITY_RANK[ceiling] else ceiling


def validate(name: str, rpm: int | None, tpm: int | None, priority: str | None) -> None:
    if not name or len(name) > 100:
        raise ApiKeyInvalid("NAME: must be 1..100 characters")
    for v, flag in ((rpm, "--rpm"), (tpm, "--tpm")):
        if v is not None and v <= 0:
            raise ApiKeyInvalid(f"{flag}: must be a positive integer, got {v}")
    if priority is not None and priority not in PRIORITIES:
        raise ApiKeyInvalid(f"--priority: expected one of {', '.join(PRIORITIES)}, got {priority!r}")


def new_key(name: str, rpm: int | None, tpm: int | None, priority: str | None, now: float,
            token: Callable[[int], str] = secrets.token_urlsafe,
            hexid: Callable[[int], str] = secrets.token_hex) -> tuple[ApiKeyRecord, str]:
    """A validated new record and the key it hashes (pure but for the injected randomness)."""
    validate(name, rpm, tpm, priority)
    key = KEY_PREFIX + token(32)
    return ApiKeyRecord("k-" + hexid(4), name, hash_key(key), rpm, tpm, priority, now), key


def parse_table(raw: dict[str, str]) -> tuple[list[ApiKeyRecord], list[str]]:
    """The records of an HGETALL of `keys.API_KEYS`, and one message per malformed one."""
    out, problems = [], []
    for kid, blob in raw.items():
        try:
            out.append(ApiKeyRecord.from_json(kid, blob))
        except ValueError as e:
            problems.append(str(e))
    return out, problems


# --- Redis ---------------------------------------------------------------------------------------
def read_all(r) -> list[ApiKeyRecord]:
    """Every well-formed key record (malformed ones are logged and skipped), sorted by name."""
    recs, problems = parse_table(r.hgetall(keys.API_KEYS))
    for p in problems:
        log.error("ignoring malformed %s", p)
    return sorted(recs, key=lambda k: (k.name, k.id))


def create_key(r, name: str, rpm: int | None = None, tpm: int | None = None,
               priority: str | None = None, now: float | None = None) -> tuple[str, str]:
    """Store a new key; returns (key id, the key itself). Names are unique among live keys."""
    import time

    rec, key = new_key(name, rpm, tpm, priority, time.time() if now is None else now)
    if any(k.name == name for k in read_all(r)):
        raise ApiKeyInvalid(f"a key named {name!r} already exists (revoke it first)")
    r.hset(keys.API_KEYS, rec.id, rec.to_json())
    return rec.id, key


def list_keys(r) -> list[ApiKeyRecord]:
    return read_all(r)


def revoke_key(r, name_or_id: str) -> str:
    for rec in read_all(r):
        if name_or_id in (rec.id, rec.name):
            pipe = r.pipeline(transaction=True)
            pipe.hdel(keys.API_KEYS, rec.id)
            pipe.delete(keys.api_key_by_hash(rec.hash))  # index written by older versions
            pipe.execute()
            return rec.id
    raise NotFound("API key", name_or_id)


def names_by_id(r) -> dict[str, str]:
    return {k.id: k.name for k in read_all(r)}
