"""The Batch API's state: stored files (a record and, for uploads, the content as a list of chunks of
whole lines), batches (a record hash whose counters only grow), each batch's results (one hash per
output kind, line index -> the output line), the lease of the run task feeding a batch, what each
feeder has in flight, and the batch workers' own API key.

A line's result is written at most once, by a script that also counts it and bills its tokens to the
batch's key in the same step: a line answered twice (a worker killed after the answer, before the
write) is billed once, and none is written after the batch was sealed. docs/batch.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from llmgw.state import keys
from llmgw.state.batch_records import BatchRecord, FileRecord
from llmgw.state.keypolicy import ApiKeyRecord, hash_key, new_key, parse_table
from llmgw.state.store.base import Aggregate, Pipeline, ms

# The name of the batch workers' own key in the key table (`llmgw keys list` shows it).
BATCH_KEY_NAME = "llmgw-batch"
PAGE = 500  # result lines read per round trip
UPLOAD_TTL = 3600  # seconds the chunks of an upload in progress live before its record is committed

# KEYS: batch, output hash, error hash, usage hash or "", budget counter or ""
# ARGV: index, kind (o|e), line, prompt, completion, model, budget ttl
# Returns 1 (written), 0 (the line was written before: nothing done), -1 (sealed, or no such batch).
_RECORD_LINE = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'sealed_at') == 1 then
  return -1
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return 0
end
local ok = ARGV[2] == 'o'
redis.call('HSET', ok and KEYS[2] or KEYS[3], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[1], ok and 'n_completed' or 'n_failed', 1)
redis.call('HINCRBY', KEYS[1], ok and 'out_bytes' or 'err_bytes', string.len(ARGV[3]) + 1)
local p, c = tonumber(ARGV[4]), tonumber(ARGV[5])
if p > 0 then redis.call('HINCRBY', KEYS[1], 'prompt_tokens', p) end
if c > 0 then redis.call('HINCRBY', KEYS[1], 'completion_tokens', c) end
if KEYS[4] ~= '' then
  redis.call('HINCRBY', KEYS[4], ARGV[6] .. ':prompt', p)
  redis.call('HINCRBY', KEYS[4], ARGV[6] .. ':completion', c)
  redis.call('HINCRBY', KEYS[4], ARGV[6] .. ':requests', 1)
end
if KEYS[5] ~= '' and p + c > 0 then
  redis.call('INCRBY', KEYS[5], p + c)
  redis.call('EXPIRE', KEYS[5], tonumber(ARGV[7]))
end
return 1
"""

# Seal a batch once: no line is written after it. KEYS: batch; ARGV: field, JSON value, ... Returns 0
# when it was sealed before (nothing written).
_SEAL = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'sealed_at') == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# The final facts of a sealed batch (its status, its files), out of the active set, counted by status.
# KEYS: batch, active set, ended counts; ARGV: id, status, field, JSON value, ...
_FINISH = """
if redis.call('HEXISTS', KEYS[1], 'sealed_at') == 0 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
if redis.call('SREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
end
return 1
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_HSET_IF_OPEN = """
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('HEXISTS', KEYS[1], 'sealed_at') == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Bill:
    """Whom a line's tokens are billed to: the key's usage per model, and its budget period's counter."""

    key_id: str
    model: str
    period_id: str | None = None  # the key's budget period now (None: the key has no budget)
    period_ttl: int = 0


@dataclass(frozen=True)
class Feeder:
    token: str
    inflight: int
    ts: float


def _hset_args(fields: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in fields.items():
        out += [k, json.dumps(v)]
    return out


def _encoded(fields: Mapping[str, Any]) -> dict[str, str]:
    return {k: json.dumps(v) for k, v in fields.items()}


def _decode(h: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for k, v in h.items():
        try:
            out[k] = json.loads(v)
        except ValueError:
            continue
    return out


def _page(r, index: str, after: str | None, limit: int, newest_first: bool) -> list[str]:
    """Up to `limit` ids of a sorted set by created_at, after the id `after` (OpenAI's cursor)."""
    start = 0
    if after:
        rank = r.zrevrank(index, after) if newest_first else r.zrank(index, after)
        if rank is None:
            return []
        start = rank + 1
    fetch = r.zrevrange if newest_first else r.zrange
    return list(fetch(index, start, start + limit - 1))


class Batches(Aggregate):
    # --- files ---------------------------------------------------------------------------------------
    def append_file_chunk(self, file_id: str, chunk: str) -> None:
        """One more chunk of an upload's content (whole lines), before its record is committed; it
        expires unless committed (a gateway that died mid-upload leaves nothing for good)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(keys.file_data(file_id), chunk)
        pipe.expire(keys.file_data(file_id), UPLOAD_TTL)
        pipe.execute()

    def drop_file_data(self, file_id: str) -> None:
        """Forget the chunks of an upload that was refused (no record was committed)."""
        self.r.delete(keys.file_data(file_id))

    def commit_file(self, rec: FileRecord) -> None:
        """The file's record and its place in the listings, in one MULTI: from now on it exists."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.file_record(rec.id), mapping=_encoded(rec.to_fields()))
        pipe.persist(keys.file_data(rec.id))
        pipe.zadd(keys.FILES, {rec.id: rec.created_at})
        pipe.zadd(keys.owner_files(rec.owner), {rec.id: rec.created_at})
        pipe.execute()

    def file(self, file_id: str) -> FileRecord | None:
        h = self.r.hgetall(keys.file_record(file_id))
        if not h:
            return None
        try:
            return FileRecord.from_fields(_decode(h))
        except (TypeError, ValueError):
            return None

    def file_chunks(self, file_id: str, start: int = 0) -> Iterator[str]:
        """An upload's content, chunk by chunk from chunk `start` (one round trip each: never the whole
        file in memory). Ends early if the file is deleted meanwhile."""
        i = start
        while True:
            got = self.r.lrange(keys.file_data(file_id), i, i)
            if not got:
                return
            yield got[0]
            i += 1

    def list_files(self, owner: str | None, after: str | None = None, limit: int = 100,
                   newest_first: bool = True) -> list[FileRecord]:
        """A page of files: one owner's (None: everyone's)."""
        index = keys.FILES if owner is None else keys.owner_files(owner)
        ids = _page(self.r, index, after, limit, newest_first)
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(keys.file_record(i))
        out = []
        for h in pipe.execute():
            if h:
                try:
                    out.append(FileRecord.from_fields(_decode(h)))
                except (TypeError, ValueError):
                    continue
        return out

    def delete_file(self, rec: FileRecord) -> None:
        """The record, its listings, and its content: an upload's chunks, or the results of its kind."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(keys.file_record(rec.id), keys.file_data(rec.id))
        pipe.zrem(keys.FILES, rec.id)
        pipe.zrem(keys.owner_files(rec.owner), rec.id)
        if rec.batch_id and rec.kind in ("output", "error"):
            pipe.delete(keys.batch_results(rec.batch_id, rec.kind[0]))
        pipe.execute()

    # --- batches -------------------------------------------------------------------------------------
    def create_batch(self, rec: BatchRecord) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.batch(rec.id), mapping=_encoded(rec.to_fields()))
        pipe.zadd(keys.BATCHES, {rec.id: rec.created_at})
        pipe.zadd(keys.owner_batches(rec.owner), {rec.id: rec.created_at})
        if not rec.ended:
            pipe.sadd(keys.BATCHES_ACTIVE, rec.id)
        pipe.execute()

    def batch(self, batch_id: str) -> BatchRecord | None:
        found = self.batches([batch_id])
        return found[0] if found else None

    def batches(self, ids: Sequence[str]) -> list[BatchRecord]:
        """The readable records of `ids`, in that order (gone or unreadable ones are left out)."""
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(keys.batch(i))
        out = []
        for h in pipe.execute():
            if h:
                try:
                    out.append(BatchRecord.from_fields(_decode(h)))
                except (TypeError, ValueError):
                    continue
        return out

    def list_batches(self, owner: str | None, after: str | None = None, limit: int = 20) -> list[BatchRecord]:
        """A page of batches, newest first: one owner's (None: everyone's)."""
        index = keys.BATCHES if owner is None else keys.owner_batches(owner)
        return self.batches(_page(self.r, index, after, limit, True))

    def active_batch_ids(self) -> list[str]:
        return sorted(self.r.smembers(keys.BATCHES_ACTIVE))

    def forget_active(self, batch_id: str) -> None:
        """Drop the id of a batch whose record is gone from the active set."""
        self.r.srem(keys.BATCHES_ACTIVE, batch_id)

    def update_batch(self, batch_id: str, **facts) -> bool:
        """Set some facts of a batch that exists and is not sealed (a sealed batch is final)."""
        if not facts:
            return True
        return bool(self.r.eval(_HSET_IF_OPEN, 1, keys.batch(batch_id), *_hset_args(facts)))

    def seal_batch(self, batch_id: str, **facts) -> bool:
        """Seal the batch (`sealed_at` among `facts`): no line is recorded afterwards. False when it
        was sealed before (by another run) or is gone."""
        assert "sealed_at" in facts
        return bool(self.r.eval(_SEAL, 1, keys.batch(batch_id), *_hset_args(facts)))

    def finish_batch(self, batch_id: str, status: str, **facts) -> bool:
        """The final facts of a sealed batch (its status time, its files); it leaves the active set and
        counts as one more batch ended with `status`."""
        return bool(self.r.eval(_FINISH, 3, keys.batch(batch_id), keys.BATCHES_ACTIVE, keys.BATCHES_ENDED, batch_id,
                                status, *_hset_args(facts)))

    def batch_stats(self) -> tuple[list[BatchRecord], dict[str, int]]:
        """The batches not ended yet, and how many ended with each final status (the metrics)."""
        ended = {k: int(v) for k, v in self.r.hgetall(keys.BATCHES_ENDED).items()}
        return self.batches(self.active_batch_ids()), ended

    def create_batch_file(self, rec: FileRecord) -> None:
        """A batch's output or error file (its content is the batch's results): written again with the
        same id by a run that finishes a batch another run sealed."""
        self.commit_file(rec)

    def record_line(self, batch_id: str, index: int, ok: bool, line: str, prompt: int = 0, completion: int = 0,
                    bill: Bill | None = None) -> int:
        """Write line `index`'s result to the output (`ok`) or error file, count it and bill its tokens,
        unless it was written before. 1 written, 0 written before (nothing done), -1 the batch is sealed."""
        usage = keys.usage(bill.key_id) if bill else ""
        budget = keys.budget(bill.key_id, bill.period_id) if bill and bill.period_id else ""
        return int(self.r.eval(
            _RECORD_LINE, 5, keys.batch(batch_id), keys.batch_results(batch_id, "o"), keys.batch_results(batch_id, "e"),
            usage, budget, index, "o" if ok else "e", line, max(0, prompt), max(0, completion),
            bill.model if bill else "", bill.period_ttl if bill else 0))

    def answered(self, batch_id: str, indexes: Sequence[int]) -> set[int]:
        """Which of `indexes` have a result (either file)."""
        if not indexes:
            return set()
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(keys.batch_results(batch_id, "o"), list(indexes))
        pipe.hmget(keys.batch_results(batch_id, "e"), list(indexes))
        out, err = pipe.execute()
        return {i for i, a, b in zip(indexes, out, err) if a is not None or b is not None}

    def result_lines(self, batch_id: str, kind: str, total: int) -> Iterator[list[str]]:
        """The lines of a batch's output ("output") or error ("error") file, in line order, a page at
        a time (one round trip per PAGE lines)."""
        key = keys.batch_results(batch_id, kind[0])
        for start in range(0, total, PAGE):
            got = self.r.hmget(key, list(range(start, min(total, start + PAGE))))
            yield [v for v in got if v is not None]

    # --- who feeds a batch -----------------------------------------------------------------------------
    def take_batch_lease(self, batch_id: str, token: str, ttl: float) -> bool:
        return bool(self.r.set(keys.batch_lease(batch_id), token, nx=True, px=ms(ttl)))

    def renew_batch_lease(self, batch_id: str, token: str, ttl: float) -> bool:
        """Extend our lease; False if it expired (and may be another's now)."""
        return bool(self.r.eval(_RENEW, 1, keys.batch_lease(batch_id), token, ms(ttl)))

    def release_batch_lease(self, batch_id: str, token: str) -> None:
        self.r.eval(_RELEASE, 1, keys.batch_lease(batch_id), token)

    def batch_leases(self, ids: Sequence[str]) -> dict[str, bool]:
        """For each batch, whether a run task holds its lease or was sent and has not started."""
        if not ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.exists(keys.batch_lease(i), keys.batch_queued(i))
        return {i: bool(n) for i, n in zip(ids, pipe.execute())}

    def mark_batch_queued(self, batch_id: str, ttl: float) -> bool:
        """Note that a run task was sent (True), unless one was already on its way (False)."""
        return bool(self.r.set(keys.batch_queued(batch_id), "1", nx=True, px=ms(ttl)))

    def clear_batch_queued(self, batch_id: str) -> None:
        self.r.delete(keys.batch_queued(batch_id))

    # --- what the feeders of one model have in flight ------------------------------------------------
    def write_feeder(self, model: str, token: str, inflight: int, now: float) -> None:
        self.r.hset(keys.batch_feeders(model), token, json.dumps({"inflight": inflight, "ts": now}))

    def drop_feeder(self, model: str, token: str) -> None:
        self.r.hdel(keys.batch_feeders(model), token)

    def feeders(self, model: str, now: float, stale_after: float) -> list[Feeder]:
        """The feeders of `model` heard from within `stale_after` seconds (older entries, of run tasks
        that died, are removed here)."""
        out, stale = [], []
        for token, raw in self.r.hgetall(keys.batch_feeders(model)).items():
            try:
                d = json.loads(raw)
                f = Feeder(token, int(d["inflight"]), float(d["ts"]))
            except (ValueError, KeyError, TypeError):
                stale.append(token)
                continue
            if now - f.ts <= stale_after:
                out.append(f)
            else:
                stale.append(token)
        if stale:
            self.r.hdel(keys.batch_feeders(model), *stale)
        return out

    # --- the owner's key, as the feeder checks it ------------------------------------------------------
    def key_record(self, key_id: str) -> ApiKeyRecord | None:
        """One key's record (None: revoked, or unreadable)."""
        raw = self.r.hget(keys.API_KEYS, key_id)
        if raw is None:
            return None
        try:
            return ApiKeyRecord.from_json(key_id, raw)
        except ValueError:
            return None

    def budget_spent(self, key_id: str, period_id: str) -> int:
        """Tokens the key spent in the period, as every gateway and batch worker wrote them so far."""
        return int(self.r.get(keys.budget(key_id, period_id)) or 0)

    # --- the batch workers' own key --------------------------------------------------------------------
    def batch_credential(self) -> str | None:
        return self.r.get(keys.BATCH_CREDENTIAL)

    def ensure_batch_credential(self, now: float | None = None) -> str:
        """The batch workers' API key: the stored one while its record is in the key table, else a new
        key (named BATCH_KEY_NAME, priority `sheddable`: its requests can claim nothing higher) replacing
        any old record of that name. One transaction, so two workers end with the same key."""
        now = time.time() if now is None else now
        out: list[str] = []

        def txn(pipe: Pipeline) -> None:
            raw = pipe.get(keys.BATCH_CREDENTIAL)
            recs, _ = parse_table(pipe.hgetall(keys.API_KEYS))
            if raw and any(r.hash == hash_key(raw) for r in recs):
                pipe.multi()
                out[:] = [raw]
                return
            rec, key = new_key(BATCH_KEY_NAME, None, None, "batch", now)
            old: list[ApiKeyRecord] = [r for r in recs if r.name == BATCH_KEY_NAME]
            pipe.multi()
            for r in old:
                pipe.hdel(keys.API_KEYS, r.id)
            pipe.hset(keys.API_KEYS, rec.id, rec.to_json())
            pipe.set(keys.BATCH_CREDENTIAL, key)
            out[:] = [key]

        self.r.transaction(txn, keys.BATCH_CREDENTIAL, keys.API_KEYS)
        return out[0]
