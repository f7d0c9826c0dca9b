"""Thin access to llmgw's state in Redis: nodes, replicas, loads, endpoints, locks.

No decisions here: these functions read and write the records of `llmgw.state.records` under the keys of
`llmgw.state.keys`. The catalog's own storage (versioned, compare-and-set) lives in `llmgw.catalog.store`.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping

import redis

from llmgw.state import events, keys
from llmgw.state.records import (
    DemandHint,
    EndpointInfo,
    ExternalRecord,
    GatewayReport,
    LoadRecord,
    NodeAdmin,
    NodeInfo,
    ReplicaRecord,
    ScaleState,
)


def connect(url: str, **kw) -> redis.Redis:
    """A client with short timeouts: every caller is a loop that must not hang on a dead Redis."""
    kw.setdefault("socket_timeout", 5)
    kw.setdefault("socket_connect_timeout", 2)
    kw.setdefault("health_check_interval", 15)
    return redis.Redis.from_url(url, decode_responses=True, **kw)


# Update fields only while the record exists, so an agent reporting on a replica the control plane
# just deleted cannot resurrect half a record.
_HSET_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
  return 1
end
return 0
"""

class Store:
    def __init__(self, r: redis.Redis):
        self.r = r

    # --- nodes -----------------------------------------------------------------------------------
    def write_heartbeat(self, info: NodeInfo, ttl: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keys.node_heartbeat(info.name), json.dumps(info.to_dict()), px=int(ttl * 1000))
        pipe.sadd(keys.NODES, info.name)
        if info.heartbeat_at:
            pipe.hset(keys.NODES_LAST_SEEN, info.name, repr(info.heartbeat_at))
        pipe.execute()

    def nodes_last_seen(self) -> dict[str, float]:
        """Node name -> time of its last heartbeat (also for nodes whose heartbeat has expired)."""
        out = {}
        for name, raw in self.r.hgetall(keys.NODES_LAST_SEEN).items():
            try:
                out[name] = float(raw)
            except ValueError:
                pass
        return out

    def forget_nodes(self, names: Iterable[str]) -> None:
        """Drop every trace of nodes that are gone for good (housekeeping decides which)."""
        names = list(names)
        if not names:
            return
        pipe = self.r.pipeline(transaction=False)
        pipe.srem(keys.NODES, *names)
        pipe.hdel(keys.NODES_MISSING_SINCE, *names)
        pipe.hdel(keys.NODES_LAST_SEEN, *names)
        for name in names:
            pipe.delete(keys.agent_wake(name), keys.node_replicas(name), keys.node_admin(name))
        pipe.execute()

    def nodes_missing_since(self) -> dict[str, float]:
        """Node -> when housekeeping first saw it without a heartbeat (unreadable entries are skipped:
        their clock starts again)."""
        out = {}
        for name, raw in self.r.hgetall(keys.NODES_MISSING_SINCE).items():
            try:
                out[name] = float(raw)
            except ValueError:
                pass
        return out

    def note_missing_nodes(self, first_missing: Mapping[str, float],
                           back: Iterable[str]) -> tuple[list[str], list[str]]:
        """Start the missing clock of nodes just seen without a heartbeat; stop it for those back.
        Returns (the nodes whose clock this call started, those whose clock it stopped): of several
        control workers noticing the same node, exactly one is told (HSETNX, HDEL), and announces it."""
        back, first = list(back), list(first_missing.items())
        pipe = self.r.pipeline(transaction=False)
        for n in back:
            pipe.hdel(keys.NODES_MISSING_SINCE, n)
        for n, t in first:
            pipe.hsetnx(keys.NODES_MISSING_SINCE, n, repr(t))
        done = pipe.execute()
        stopped = [n for n, ok in zip(back, done) if ok]
        started = [n for (n, _t), ok in zip(first, done[len(back):]) if ok]
        return started, stopped

    def known_nodes(self) -> set[str]:
        return set(self.r.smembers(keys.NODES))

    def live_nodes(self) -> dict[str, NodeInfo]:
        names = sorted(self.known_nodes())
        if not names:
            return {}
        raw = self.r.mget([keys.node_heartbeat(n) for n in names])
        return {n: NodeInfo.from_dict(json.loads(v)) for n, v in zip(names, raw) if v}

    def node_admin(self, name: str) -> NodeAdmin:
        h = self.r.hgetall(keys.node_admin(name))
        return NodeAdmin(cordoned=h.get("cordoned") == "1", draining=h.get("draining") == "1")

    def all_node_admin(self, names: Iterable[str]) -> dict[str, NodeAdmin]:
        names = list(names)
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.node_admin(n))
        out = {}
        for n, h in zip(names, pipe.execute()):
            out[n] = NodeAdmin(cordoned=h.get("cordoned") == "1", draining=h.get("draining") == "1")
        return out

    def set_node_admin(self, name: str, **flags: bool) -> None:
        self.r.hset(keys.node_admin(name), mapping={k: "1" if v else "0" for k, v in flags.items()})

    # --- replicas --------------------------------------------------------------------------------
    def create_replica(self, rec: ReplicaRecord) -> None:
        pipe = self.r.pipeline(transaction=True)
        _queue_create(pipe, rec)
        pipe.execute()

    def restore_replica(self, rec: ReplicaRecord) -> bool:
        """`create_replica`, only if no record with this id exists (WATCH/MULTI): a node agent registering
        its running engine again after Redis lost the record never overwrites one written meanwhile.
        True if it wrote the record."""
        key = keys.replica(rec.id)

        def txn(pipe: redis.client.Pipeline) -> bool:
            if pipe.exists(key):
                pipe.multi()
                return False
            pipe.multi()
            _queue_create(pipe, rec)
            return True

        return bool(self.r.transaction(txn, key, value_from_callable=True))

    def update_replica(self, replica_id: str, **fields) -> bool:
        """Set some fields of an existing record; False (and no write) if it no longer exists."""
        if not fields:
            return True
        if "node" in fields or "nodes" in fields:
            return self._update_replica_nodes(replica_id, fields)
        return bool(self.r.eval(_HSET_IF_EXISTS, 1, keys.replica(replica_id), *_hset_args(fields)))

    def update_replicas(self, updates: Mapping[str, Mapping[str, Any]]) -> set[str]:
        """`update_replica` of several records in one round trip (the agent's one write per pass);
        returns the ids whose record still exists. Not for node fields (the control plane's)."""
        ids = [rid for rid, fields in updates.items() if fields]
        if not ids:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for rid in ids:
            assert not {"node", "nodes"} & set(updates[rid]), "node fields move the index: use update_replica"
            pipe.eval(_HSET_IF_EXISTS, 1, keys.replica(rid), *_hset_args(updates[rid]))
        return {rid for rid, existed in zip(ids, pipe.execute()) if existed}

    def _update_replica_nodes(self, replica_id: str, fields: dict) -> bool:
        """`update_replica` of a record's node(s): the per-node index moves in the same MULTI."""
        key = keys.replica(replica_id)

        def txn(pipe: redis.client.Pipeline) -> bool:
            old_node, old_nodes = pipe.hmget(key, "node", "nodes")
            if old_node is None and old_nodes is None and not pipe.exists(key):
                pipe.multi()
                return False
            before = _nodes_of(old_node, old_nodes)
            node = fields["node"] if "node" in fields else (json.loads(old_node) if old_node else None)
            nodes = fields["nodes"] if "nodes" in fields else (json.loads(old_nodes) if old_nodes else [])
            after = list(nodes or []) or ([node] if node else [])
            pipe.multi()
            pipe.hset(key, mapping={k: json.dumps(v) for k, v in fields.items()})
            for n in set(before) - set(after):
                pipe.srem(keys.node_replicas(n), replica_id)
            for n in after:
                pipe.sadd(keys.node_replicas(n), replica_id)
            return True

        return bool(self.r.transaction(txn, key, value_from_callable=True))

    def get_replica(self, replica_id: str) -> ReplicaRecord | None:
        h = self.r.hgetall(keys.replica(replica_id))
        return _decode_replica(h) if h else None

    def _read_records(self, ids: list[str]) -> tuple[list[ReplicaRecord], list[str]]:
        """The records of `ids` in one round trip, and the ids whose record is gone."""
        if not ids:
            return [], []
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(keys.replica(i))
        found, gone = [], []
        for i, h in zip(ids, pipe.execute()):
            if h:
                found.append(_decode_replica(h))
            else:
                gone.append(i)
        return found, gone

    def all_replicas(self) -> list[ReplicaRecord]:
        out, stale = self._read_records(sorted(self.r.smembers(keys.REPLICAS)))
        if stale:  # a set member whose hash is gone: tidy the index
            self.r.srem(keys.REPLICAS, *stale)
        return out

    def replicas_on(self, node: str) -> list[ReplicaRecord]:
        """The records that name `node`, from the node's index set; a scan of every record while the
        index is not known to be complete (records written before it existed)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(keys.REPLICA_NODE_INDEX_READY)
        pipe.smembers(keys.node_replicas(node))
        ready, ids = pipe.execute()
        if not ready:
            return [r for r in self.all_replicas() if node in r.all_nodes]
        # An id whose record is gone is skipped: housekeeping tidies the index.
        found, _gone = self._read_records(sorted(ids))
        return [rec for rec in found if node in rec.all_nodes]

    def replica_node_index_ready(self) -> bool:
        return bool(self.r.exists(keys.REPLICA_NODE_INDEX_READY))

    def reindex_replica_nodes(self, replicas: Iterable[ReplicaRecord]) -> None:
        """Make the per-node index agree with `replicas` (all records, just read), then mark it
        complete. Only ids whose record is gone or no longer names the node are removed, so a record
        created meanwhile (indexed by its own MULTI) is never dropped."""
        by_id = {r.id: r for r in replicas}
        want: dict[str, set[str]] = {}
        for r in by_id.values():
            for n in r.all_nodes:
                want.setdefault(n, set()).add(r.id)
        names = sorted(set(want) | self.known_nodes())
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.smembers(keys.node_replicas(n))
        have = dict(zip(names, pipe.execute()))
        unknown = sorted({i for n in names for i in have[n] - want.get(n, set()) if i not in by_id})
        exists: dict[str, bool] = {}
        if unknown:
            pipe = self.r.pipeline(transaction=False)
            for i in unknown:
                pipe.exists(keys.replica(i))
            exists = dict(zip(unknown, (bool(x) for x in pipe.execute())))
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            extra = [i for i in have[n] - want.get(n, set()) if i in by_id or not exists.get(i, True)]
            if extra:
                pipe.srem(keys.node_replicas(n), *extra)
            missing = want.get(n, set()) - have[n]
            if missing:
                pipe.sadd(keys.node_replicas(n), *sorted(missing))
        pipe.set(keys.REPLICA_NODE_INDEX_READY, "1")
        pipe.execute()

    def delete_replica(self, replica_id: str) -> None:
        key = keys.replica(replica_id)

        def txn(pipe: redis.client.Pipeline) -> None:
            node, nodes = pipe.hmget(key, "node", "nodes")
            pipe.multi()
            pipe.delete(key, keys.load(replica_id))
            pipe.srem(keys.REPLICAS, replica_id)
            for n in _nodes_of(node, nodes):
                pipe.srem(keys.node_replicas(n), replica_id)

        self.r.transaction(txn, key)

    # --- load ------------------------------------------------------------------------------------
    def write_load(self, rec: LoadRecord, ttl: float = 30.0) -> None:
        self.r.set(keys.load(rec.replica_id), json.dumps(rec.to_dict()), px=int(ttl * 1000))

    def delete_loads_except(self, replica_ids: Iterable[str]) -> int:
        """Drop the load samples of replicas not in `replica_ids` (deleted ones); returns how many."""
        keep, prefix = set(replica_ids), keys.load("")
        stale = [k for k in self.r.scan_iter(match=prefix + "*", count=500) if k[len(prefix):] not in keep]
        if stale:
            self.r.delete(*stale)
        return len(stale)

    def loads(self, replica_ids: Iterable[str]) -> dict[str, LoadRecord]:
        ids = list(replica_ids)
        if not ids:
            return {}
        raw = self.r.mget([keys.load(i) for i in ids])
        return {i: LoadRecord.from_dict(json.loads(v)) for i, v in zip(ids, raw) if v}

    # --- external servers ------------------------------------------------------------------------
    def write_externals(self, records: Iterable[ExternalRecord]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for rec in records:
            pipe.set(keys.external(rec.id), json.dumps(rec.to_dict()))
            pipe.sadd(keys.EXTERNALS, rec.id)
        pipe.execute()

    def external_records(self) -> list[ExternalRecord]:
        ids = sorted(self.r.smembers(keys.EXTERNALS))
        if not ids:
            return []
        out = []
        for raw in self.r.mget([keys.external(i) for i in ids]):
            if raw:
                try:
                    out.append(ExternalRecord.from_dict(json.loads(raw)))
                except (ValueError, TypeError):
                    continue  # a record from a newer or broken writer: checked afresh, never fatal
        return out

    def delete_externals(self, ids: Iterable[str]) -> None:
        """Forget external urls that left the catalog: their records and load samples."""
        ids = list(ids)
        if ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.delete(*[keys.external(i) for i in ids], *[keys.load(i) for i in ids])
            pipe.srem(keys.EXTERNALS, *ids)
            pipe.execute()

    # --- endpoints -------------------------------------------------------------------------------
    def endpoints_version(self) -> int:
        return int(self.r.get(keys.ENDPOINTS_VERSION) or 0)

    def read_endpoints(self) -> tuple[int, str, list[EndpointInfo]]:
        """(version, fingerprint, endpoints) as last published."""
        raw = self.r.get(keys.ENDPOINTS)
        if not raw:
            return 0, "", []
        doc = json.loads(raw)
        return (
            int(doc.get("version", 0)),
            doc.get("fingerprint", ""),
            [EndpointInfo.from_dict(e) for e in doc.get("endpoints", [])],
        )

    def write_endpoints(self, endpoints: list[EndpointInfo], fingerprint: str, now: float) -> int:
        """Publish a new list: bump the version and write the list in one MULTI, then hint."""

        def txn(pipe: redis.client.Pipeline) -> int:
            version = int(pipe.get(keys.ENDPOINTS_VERSION) or 0) + 1
            doc = {
                "version": version,
                "fingerprint": fingerprint,
                "published_at": now,
                "endpoints": [e.to_dict() for e in endpoints],
            }
            pipe.multi()
            pipe.set(keys.ENDPOINTS, json.dumps(doc))
            pipe.set(keys.ENDPOINTS_VERSION, version)
            return version

        version = self.r.transaction(txn, keys.ENDPOINTS_VERSION, value_from_callable=True)
        self.r.publish(keys.ENDPOINTS_CHANNEL, str(version))
        return version

    # --- control pass counters ---------------------------------------------------------------------
    def count_pass(self, task: str, seconds: float, actions: int) -> None:
        """Count one pass of a control task (never raises: a counter must not fail a pass)."""
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.hincrby(keys.CONTROL_STATS, f"{task}:passes", 1)
            pipe.hincrbyfloat(keys.CONTROL_STATS, f"{task}:seconds", seconds)
            pipe.hincrby(keys.CONTROL_STATS, f"{task}:actions", actions)
            pipe.execute()
        except redis.RedisError:
            pass

    def control_stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.r.hgetall(keys.CONTROL_STATS).items()}

    # --- the event history ---------------------------------------------------------------------------
    def emit(self, kind: str, message: str = "", **fields) -> None:
        """Append to the event history (`llmgw.state.events.emit`); never raises."""
        events.emit(self.r, kind, message, **fields)

    def emit_limited(self, kind: str, message: str, *, subject: str, every: float, **fields) -> bool:
        """`emit`, unless an event of this kind about `subject` was written (by any process) in the
        last `every` seconds; True when written. Never raises."""
        try:
            if not self.r.set(keys.event_gate(kind, subject), "1", nx=True, px=max(1, int(every * 1000))):
                return False
        except redis.RedisError:
            return False
        self.emit(kind, message, **fields)
        return True

    # --- gateway traffic (the console's charts) ----------------------------------------------------
    def add_traffic(self, counts: Mapping[int, Mapping[str, int]], ttl: float) -> None:
        """Add one gateway process's counts to each slot's hash, in one pipeline."""
        pipe = self.r.pipeline(transaction=False)
        for slot, fields in counts.items():
            key = keys.traffic(slot)
            for name, n in fields.items():
                pipe.hincrby(key, name, n)
            pipe.expire(key, int(ttl))
        pipe.execute()

    def traffic(self, slots: Iterable[int]) -> dict[int, dict[str, str]]:
        slots = list(slots)
        pipe = self.r.pipeline(transaction=False)
        for s in slots:
            pipe.hgetall(keys.traffic(s))
        return dict(zip(slots, pipe.execute()))

    # --- gateway reports ---------------------------------------------------------------------------
    def write_gateway_report(self, report: GatewayReport, ttl: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keys.gateway_report(report.id), json.dumps(report.to_dict(), separators=(",", ":")),
                 px=int(ttl * 1000))
        pipe.sadd(keys.GATEWAYS, report.id)
        pipe.execute()

    def gateway_reports(self) -> list[GatewayReport]:
        """The reports of live gateway processes (a dead one's report has expired); expired ids are
        tidied from the set here."""
        ids = sorted(self.r.smembers(keys.GATEWAYS))
        if not ids:
            return []
        raw = self.r.mget([keys.gateway_report(i) for i in ids])
        out, gone = [], []
        for i, v in zip(ids, raw):
            if v is None:
                gone.append(i)
                continue
            try:
                out.append(GatewayReport.from_dict(json.loads(v)))
            except (ValueError, TypeError):
                continue  # a report from a newer or broken writer: ignore it, never fail the reader
        if gone:
            self.r.srem(keys.GATEWAYS, *gone)
        return out

    # --- autoscaling -------------------------------------------------------------------------------
    def write_demand_hint(self, model: str, hint: DemandHint, ttl: float) -> None:
        self.r.set(keys.demand_hint(model), json.dumps(hint.to_dict()), px=int(ttl * 1000))

    def demand_hints(self, models: Iterable[str]) -> dict[str, DemandHint]:
        models = list(models)
        if not models:
            return {}
        out = {}
        for m, raw in zip(models, self.r.mget([keys.demand_hint(m) for m in models])):
            if raw:
                try:
                    out[m] = DemandHint.from_dict(json.loads(raw))
                except (ValueError, TypeError):
                    continue  # a hint from a newer or broken writer says nothing
        return out

    def scale_states(self) -> dict[tuple[str, str], ScaleState]:
        """(model, profile) -> the autoscaler's record; unreadable entries are skipped."""
        out = {}
        for f, raw in self.r.hgetall(keys.AUTOSCALE).items():
            model, _, profile = f.rpartition("/")
            try:
                out[(model, profile)] = ScaleState.from_dict(json.loads(raw))
            except (ValueError, TypeError):
                continue
        return out

    def scale_histories(self, profiles: Iterable[tuple[str, str]], since: Mapping[tuple[str, str], float]
                        ) -> dict[tuple[str, str], list[list]]:
        """Each profile's samples (JSON lists) from `since[profile]` on, oldest first, in one round trip."""
        profiles = list(profiles)
        pipe = self.r.pipeline(transaction=False)
        for m, p in profiles:
            pipe.zrangebyscore(keys.autoscale_history(m, p), since.get((m, p), "-inf"), "+inf")
        out: dict[tuple[str, str], list[list]] = {}
        for key, members in zip(profiles, pipe.execute()):
            rows = []
            for raw in members:
                try:
                    rows.append(json.loads(raw))
                except ValueError:
                    continue
            out[key] = rows
        return out

    def write_scaling(self, states: Mapping[tuple[str, str], ScaleState],
                      samples: Mapping[tuple[str, str], tuple[float, list]],
                      keep_since: Mapping[tuple[str, str], float], keep_max: int,
                      forget: Iterable[tuple[str, str]] = ()) -> None:
        """One pipeline for a pass: each profile's state, its new sample (trimmed by age and count), and
        the records of profiles that no longer autoscale deleted."""
        pipe = self.r.pipeline(transaction=False)
        if states:
            pipe.hset(keys.AUTOSCALE, mapping={keys.autoscale_field(m, p): json.dumps(st.to_dict())
                                               for (m, p), st in states.items()})
        for (m, p), (t, row) in samples.items():
            h = keys.autoscale_history(m, p)
            pipe.zadd(h, {json.dumps(row, separators=(",", ":")): t})
            pipe.zremrangebyscore(h, "-inf", f"({keep_since.get((m, p), float('-inf'))!r}")
            pipe.zremrangebyrank(h, 0, -(keep_max + 1))
        gone = list(forget)
        if gone:
            pipe.hdel(keys.AUTOSCALE, *(keys.autoscale_field(m, p) for m, p in gone))
            pipe.delete(*(keys.autoscale_history(m, p) for m, p in gone))
        pipe.execute()

    def subscribe_endpoints(self) -> redis.client.PubSub:
        """A subscription to the hint that a new endpoint list was published (close it when done)."""
        ps = self.r.pubsub(ignore_subscribe_messages=True)
        ps.subscribe(keys.ENDPOINTS_CHANNEL)
        return ps

    # --- API keys, rate limits, usage (the gateway's) ---------------------------------------------
    def api_key_table(self) -> dict[str, str]:
        """The raw key table, key id -> JSON record (`llmgw.state.apikeys.parse_table` reads it)."""
        return self.r.hgetall(keys.API_KEYS)

    def key_usage(self, key_id: str) -> dict[str, str]:
        """The raw usage hash of one key (`llmgw.state.apikeys.usage_by_model` reads it)."""
        return self.r.hgetall(keys.usage(key_id))

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

    # --- engine credentials ------------------------------------------------------------------------
    def credential_generations(self) -> dict[str, int]:
        """Model (or `keys.ALL_MODELS`) -> how often its engine credentials were rotated."""
        out = {}
        for name, raw in self.r.hgetall(keys.ENGINE_CREDENTIALS).items():
            try:
                out[name] = int(raw)
            except ValueError:
                pass
        return out

    def rotate_credentials(self, model: str | None) -> int:
        """Mark the replicas of `model` (None: every model) outdated: the next reconcile replaces them
        by a rolling update with fresh secrets. Returns the new generation of that name."""
        return int(self.r.hincrby(keys.ENGINE_CREDENTIALS, model or keys.ALL_MODELS, 1))

    # --- agent wake-ups ----------------------------------------------------------------------------
    def wake_agent(self, node: str, replica_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(keys.agent_wake(node), replica_id)
        pipe.ltrim(keys.agent_wake(node), -1000, -1)
        pipe.execute()

    def wait_for_wake(self, node: str, timeout: float) -> bool:
        """Block until a launch/stop task wakes `node`'s agent, or `timeout` seconds; every pending
        wake-up is taken at once, since one pass handles them all."""
        if self.r.blpop([keys.agent_wake(node)], timeout=timeout):
            self.r.delete(keys.agent_wake(node))
            return True
        return False

    def close(self) -> None:
        self.r.close()

    # --- locks -----------------------------------------------------------------------------------
    @contextmanager
    def lock(self, name: str, ttl: float) -> Iterator[bool]:
        """`with store.lock(key, ttl) as held:` -- one try, never waiting: held is False if another
        holder has it. redis-py's Lock: a token under `name` that expires after `ttl` seconds and is
        released only by its owner."""
        lock = self.r.lock(name, timeout=ttl, blocking=False)
        held = lock.acquire()
        try:
            yield held
        finally:
            if held:
                try:
                    lock.release()
                except redis.exceptions.LockError:
                    pass  # it expired (and may be another's now): nothing of ours left to release


def _queue_create(pipe: redis.client.Pipeline, rec: ReplicaRecord) -> None:
    """The writes of a new record: its hash, the set of ids, the per-node index."""
    pipe.hset(keys.replica(rec.id), mapping={k: json.dumps(v) for k, v in rec.to_dict().items()})
    pipe.sadd(keys.REPLICAS, rec.id)
    for n in rec.all_nodes:
        pipe.sadd(keys.node_replicas(n), rec.id)


def _hset_args(fields: Mapping[str, Any]) -> list[str]:
    argv: list[str] = []
    for k, v in fields.items():
        argv += [k, json.dumps(v)]
    return argv


def _decode_replica(h: dict[str, str]) -> ReplicaRecord:
    return ReplicaRecord.from_dict({k: json.loads(v) for k, v in h.items()})


def _nodes_of(node_raw: str | None, nodes_raw: str | None) -> list[str]:
    """A stored record's nodes (head first) from its raw `node` and `nodes` fields."""
    try:
        nodes = json.loads(nodes_raw) if nodes_raw else []
        node = json.loads(node_raw) if node_raw else None
    except ValueError:
        return []
    return [n for n in (list(nodes or []) or ([node] if node else [])) if isinstance(n, str)]
