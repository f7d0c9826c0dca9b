"""Thin access to llmgw's state in Redis: nodes, replicas, loads, endpoints, locks.

No decisions here: these functions read and write the records of `llmgw.records` under the keys of
`llmgw.keys`. The catalog's own storage (versioned, compare-and-set) lives in `llmgw.catalog_store`.
"""

from __future__ import annotations

import json
import secrets
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import redis

from llmgw import keys
from llmgw.records import EndpointInfo, GatewayReport, LoadRecord, NodeAdmin, NodeInfo, ReplicaRecord


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

# Release a lock only if we still own it.
_COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
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
        data = {k: json.dumps(v) for k, v in rec.to_dict().items()}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.replica(rec.id), mapping=data)
        pipe.sadd(keys.REPLICAS, rec.id)
        for n in rec.all_nodes:
            pipe.sadd(keys.node_replicas(n), rec.id)
        pipe.execute()

    def update_replica(self, replica_id: str, **fields) -> bool:
        """Set some fields of an existing record; False (and no write) if it no longer exists."""
        if not fields:
            return True
        if "node" in fields or "nodes" in fields:
            return self._update_replica_nodes(replica_id, fields)
        argv: list[str] = []
        for k, v in fields.items():
            argv += [k, json.dumps(v)]
        return bool(self.r.eval(_HSET_IF_EXISTS, 1, keys.replica(replica_id), *argv))

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

    def loads(self, replica_ids: Iterable[str]) -> dict[str, LoadRecord]:
        ids = list(replica_ids)
        if not ids:
            return {}
        raw = self.r.mget([keys.load(i) for i in ids])
        return {i: LoadRecord.from_dict(json.loads(v)) for i, v in zip(ids, raw) if v}

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

    # --- agent wake-ups ----------------------------------------------------------------------------
    def wake_agent(self, node: str, replica_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(keys.agent_wake(node), replica_id)
        pipe.ltrim(keys.agent_wake(node), -1000, -1)
        pipe.execute()

    # --- locks -----------------------------------------------------------------------------------
    @contextmanager
    def lock(self, name: str, ttl: float) -> Iterator[bool]:
        """`with store.lock(key, ttl) as held:` -- held is False if another holder has it."""
        token = secrets.token_hex(8)
        held = bool(self.r.set(name, token, nx=True, px=int(ttl * 1000)))
        try:
            yield held
        finally:
            if held:
                self.r.eval(_COMPARE_AND_DELETE, 1, name, token)


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


class Clock:
    """The real clock; tests pass a fake with the same two methods."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()
