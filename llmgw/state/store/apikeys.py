"""API keys: the key table (one hash, key id -> JSON record; never the key itself, only its hash),
each key's usage per model, its rate-limit windows per minute and its budget counters per period.

The gateway caches the whole table in memory, so it needs no by-hash index: `keys.api_key_by_hash`
is never written, only deleted on revoke (records made by older versions had one). The record type
and its policy are `llmgw.state.keypolicy` (pure).

Every change of the table is an event in the history, in the same transaction (`key_created`,
`key_updated`, `key_revoked`), naming who made it (`by`: `user@host` from the CLI, `admin key 'ops'`
from the console) and where (`source`: cli, console).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Mapping

from llmgw.errors import NotFound
from llmgw.state import keys
from llmgw.state.keypolicy import (ApiKeyInvalid, ApiKeyRecord, budget_status, check_changes, describe_key, new_key,
                                   parse_table, updated)
from llmgw.state.store.base import Aggregate, Pipeline
from llmgw.state.store.events import queue_event

log = logging.getLogger("llmgw.state.store.apikeys")


class ApiKeys(Aggregate):
    # --- the key table (the CLI's) ---------------------------------------------------------------
    def api_key_table(self) -> dict[str, str]:
        """The raw key table, key id -> JSON record (`llmgw.state.keypolicy.parse_table` reads it)."""
        return self.r.hgetall(keys.API_KEYS)

    def list_keys(self) -> list[ApiKeyRecord]:
        """Every well-formed key record (malformed ones are logged and skipped), sorted by name."""
        recs, problems = parse_table(self.api_key_table())
        for p in problems:
            log.error("ignoring malformed %s", p)
        return sorted(recs, key=lambda k: (k.name, k.id))

    def find_key(self, name_or_id: str) -> ApiKeyRecord:
        for rec in self.list_keys():
            if name_or_id in (rec.id, rec.name):
                return rec
        raise NotFound("API key", name_or_id)

    def key_names(self) -> dict[str, str]:
        """Key id -> name, of every well-formed record."""
        return {k.id: k.name for k in self.list_keys()}

    def create_key(self, name: str, rpm: int | None = None, tpm: int | None = None,
                   priority: str | None = None, now: float | None = None, *, by: str = "", source: str = "cli",
                   first: bool = False, **policy) -> tuple[str, str]:
        """Store a new key; returns (key id, the key itself). Names are unique among live keys. With
        `first`, only while no key exists at all (the console's first key; ApiKeyInvalid otherwise).
        Confirmed on the replicas `durability` asks for: a key handed out must not vanish in a failover
        (when they fall short, NotReplicated says so; the key is stored and its `value` is (key id, key))."""
        rec, key = new_key(name, rpm, tpm, priority, time.time() if now is None else now, **policy)

        def txn(pipe: Pipeline) -> None:
            recs, _ = parse_table(pipe.hgetall(keys.API_KEYS))
            if first and pipe.hlen(keys.API_KEYS):
                raise ApiKeyInvalid("a key exists already: only an admin key may create more")
            if any(k.name == name for k in recs):
                raise ApiKeyInvalid(f"a key named {name!r} already exists (revoke it first)")
            pipe.multi()
            pipe.hset(keys.API_KEYS, rec.id, rec.to_json())
            _event(pipe, "key_created", rec, f"created by {by or 'an unnamed caller'}: {describe_key(rec)}", by,
                   source)

        def write(r) -> tuple[str, str]:
            r.transaction(txn, keys.API_KEYS)
            return rec.id, key

        return self.durably(f"API key {name!r}", write)

    def update_key(self, name_or_id: str, *, by: str = "", source: str = "cli", **changes) -> ApiKeyRecord:
        """Change a key's limits or policy (`keypolicy.updated`), never the key itself; returns the new
        record. Compare-and-set on the table, so two updates of one key never lose each other's change.
        Confirmed on the replicas `durability` asks for, as `create_key`."""
        changes = check_changes(changes)
        out: list[ApiKeyRecord] = []

        def txn(pipe: Pipeline) -> None:
            recs, _ = parse_table(pipe.hgetall(keys.API_KEYS))
            rec = next((k for k in recs if name_or_id in (k.id, k.name)), None)
            if rec is None:
                raise NotFound("API key", name_or_id)
            new = updated(rec, changes)
            pipe.multi()
            pipe.hset(keys.API_KEYS, new.id, new.to_json())
            changed = ", ".join(sorted(changes)) or "nothing"
            _event(pipe, "key_updated", new, f"{changed} changed by {by or 'an unnamed caller'}: {describe_key(new)}",
                   by, source, changed=sorted(changes))
            out[:] = [new]

        def write(r) -> ApiKeyRecord:
            r.transaction(txn, keys.API_KEYS)
            return out[0]

        return self.durably(f"the change of API key {name_or_id!r}", write)

    def revoke_key(self, name_or_id: str, *, by: str = "", source: str = "cli") -> str:
        """Delete a key; returns its id. Confirmed on the replicas `durability` asks for: a revoked key
        that a failover brought back would work again."""
        rec = self.find_key(name_or_id)

        def write(r) -> str:
            pipe = r.pipeline(transaction=True)
            pipe.hdel(keys.API_KEYS, rec.id)
            pipe.delete(keys.api_key_by_hash(rec.hash))  # index written by older versions
            _event(pipe, "key_revoked", rec, f"revoked by {by or 'an unnamed caller'}", by, source)
            pipe.execute()
            return rec.id

        return self.durably(f"the revocation of API key {rec.name!r}", write)

    # --- usage and budgets ---------------------------------------------------------------------------
    def key_usage(self, key_id: str) -> dict[str, str]:
        """The raw usage hash of one key (`llmgw.state.keypolicy.usage_by_model` reads it)."""
        return self.r.hgetall(keys.usage(key_id))

    def all_key_usage(self, key_ids: Iterable[str] = ()) -> dict[str, dict[str, str]]:
        """The raw usage hash of every key that has one, and of `key_ids` (empty if none), by key id."""
        prefix = keys.usage("")
        ids = sorted(set(key_ids) | {k[len(prefix):] for k in self.r.scan_iter(match=prefix + "*", count=500)})
        pipe = self.r.pipeline(transaction=False)
        for kid in ids:
            pipe.hgetall(keys.usage(kid))
        return dict(zip(ids, pipe.execute()))

    def key_budgets(self, now: float) -> list[dict]:
        """The budget of every key that has one, with its tokens spent this period (as flushed to Redis)."""
        recs = [k for k in self.list_keys() if k.budget]
        if not recs:
            return []
        spent = self.r.mget([keys.budget(k.id, k.period(now).id) for k in recs])  # type: ignore[union-attr]
        return [{"key": k.name, "id": k.id, **budget_status(k, int(s or 0), now)}  # type: ignore[arg-type]
                for k, s in zip(recs, spent)]

    # --- the gateway's counters ----------------------------------------------------------------------
    def count_request(self, key_id: str, minute: int, rpm: bool, tpm: bool) -> tuple[int | None, int]:
        """One round trip for a key's limits in this minute's windows: count this request against its
        requests-per-minute window (when `rpm`) and read its tokens so far (when `tpm`). Returns
        (requests including this one or None, tokens so far)."""
        pipe = self.r.pipeline(transaction=False)
        if rpm:
            pipe.incr(keys.rate_window(key_id, "rpm", minute))
            pipe.expire(keys.rate_window(key_id, "rpm", minute), 120)
        if tpm:
            pipe.get(keys.rate_window(key_id, "tpm", minute))
        out = pipe.execute()
        return (int(out[0]) if rpm else None), (int(out[-1] or 0) if tpm else 0)

    def add_usage(self, usage: Mapping[tuple[str, str], tuple[int, int, int]],
                  tokens: Mapping[tuple[str, int], int],
                  budgets: Mapping[tuple[str, str], tuple[int, int]] | None = None,
                  read: Iterable[tuple[str, str]] = ()) -> list[int]:
        """Add counted usage in one pipeline: (key id, model) -> (prompt, completion, requests),
        (key id, minute) -> tokens for the tokens-per-minute windows, and (key id, budget period id)
        -> (tokens, counter TTL) for budgets. Then, in the same round trip, read the budget counters
        of `read` ((key id, period id) pairs): what every gateway flushed so far, this one included."""
        read = list(read)
        pipe = self.r.pipeline(transaction=False)
        for (kid, model), (p, c, n) in usage.items():
            h = keys.usage(kid)
            pipe.hincrby(h, f"{model}:prompt", p)
            pipe.hincrby(h, f"{model}:completion", c)
            pipe.hincrby(h, f"{model}:requests", n)
        for (kid, minute), n in tokens.items():
            pipe.incrby(keys.rate_window(kid, "tpm", minute), n)
            pipe.expire(keys.rate_window(kid, "tpm", minute), 120)
        for (kid, period), (n, ttl) in (budgets or {}).items():
            pipe.incrby(keys.budget(kid, period), n)
            pipe.expire(keys.budget(kid, period), ttl)
        if read:
            pipe.mget([keys.budget(kid, period) for kid, period in read])
        out = pipe.execute()
        return [int(v or 0) for v in out[-1]] if read else []


def _event(pipe, kind: str, rec: ApiKeyRecord, what: str, by: str, source: str, **data) -> None:
    """A key's change in the event history, in the transaction that makes it (never its secret or hash)."""
    queue_event(pipe, kind, f"API key {rec.name!r} ({rec.id}) {what}", source=source, key=rec.name, key_id=rec.id,
                by=by, **data)
