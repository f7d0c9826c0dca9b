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
from llmgw.records import EndpointInfo, LoadRecord, NodeAdmin, NodeInfo, ReplicaRecord


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
        pipe.execute()

    def update_replica(self, replica_id: str, **fields) -> bool:
        """Set some fields of an existing record; False (and no write) if it no longer exists."""
        if not fields:
            return True
        argv: list[str] = []
        for k, v in fields.items():
            argv += [k, json.dumps(v)]
        return bool(self.r.eval(_HSET_IF_EXISTS, 1, keys.replica(replica_id), *argv))

    def get_replica(self, replica_id: str) -> ReplicaRecord | None:
        h = self.r.hgetall(keys.replica(replica_id))
        return _decode_replica(h) if h else None

    def all_replicas(self) -> list[ReplicaRecord]:
        ids = sorted(self.r.smembers(keys.REPLICAS))
        if not ids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(keys.replica(i))
        out = []
        stale = []
        for i, h in zip(ids, pipe.execute()):
            if h:
                out.append(_decode_replica(h))
            else:
                stale.append(i)
        if stale:  # a set member whose hash is gone: tidy the index
            self.r.srem(keys.REPLICAS, *stale)
        return out

    def replicas_on(self, node: str) -> list[ReplicaRecord]:
        return [r for r in self.all_replicas() if node in (r.nodes or ([r.node] if r.node else []))]

    def delete_replica(self, replica_id: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(keys.replica(replica_id), keys.load(replica_id))
        pipe.srem(keys.REPLICAS, replica_id)
        pipe.execute()

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


class Clock:
    """The real clock; tests pass a fake with the same two methods."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()
