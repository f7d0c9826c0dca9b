"""Replica records: one hash per replica (each field JSON), the set of every id, and the per-node
index (`keys.node_replicas`) a node agent reads its own records by. Every write that changes a
record's node(s) moves the index in the same MULTI."""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Mapping, Sequence

from llmgw.state import keys
from llmgw.state.records import ReplicaRecord
from llmgw.state.store.base import Aggregate, Pipeline

# Update fields only while the record exists, so an agent reporting on a replica the control plane
# just deleted cannot resurrect half a record.
_HSET_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
  return 1
end
return 0
"""


# --- reads and writes other aggregates compose on their own pipeline --------------------------------
def queue_ids(pipe: Pipeline) -> None:
    pipe.smembers(keys.REPLICAS)


def queue_records(pipe: Pipeline, ids: Iterable[str]) -> None:
    for i in ids:
        pipe.hgetall(keys.replica(i))


def take_records(ids: Sequence[str], replies: Iterator) -> tuple[list[ReplicaRecord], list[str]]:
    """The records of `ids`, and the ids whose record is gone."""
    found, gone = [], []
    for i in ids:
        h = next(replies)
        if h:
            found.append(_decode(h))
        else:
            gone.append(i)
    return found, gone


def queue_update(pipe: Pipeline, replica_id: str, fields: Mapping[str, Any]) -> None:
    """Set some (non-node) fields of a record if it still exists; the reply says whether it did."""
    pipe.eval(_HSET_IF_EXISTS, 1, keys.replica(replica_id), *_hset_args(fields))


class Replicas(Aggregate):
    def create_replica(self, rec: ReplicaRecord) -> None:
        pipe = self.r.pipeline(transaction=True)
        _queue_create(pipe, rec)
        pipe.execute()

    def restore_replica(self, rec: ReplicaRecord) -> bool:
        """`create_replica`, only if no record with this id exists (WATCH/MULTI): a node agent registering
        its running engine again after Redis lost the record never overwrites one written meanwhile.
        True if it wrote the record."""
        key = keys.replica(rec.id)

        def txn(pipe: Pipeline) -> bool:
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
            queue_update(pipe, rid, updates[rid])
        return {rid for rid, existed in zip(ids, pipe.execute()) if existed}

    def _update_replica_nodes(self, replica_id: str, fields: dict) -> bool:
        """`update_replica` of a record's node(s): the per-node index moves in the same MULTI."""
        key = keys.replica(replica_id)

        def txn(pipe: Pipeline) -> bool:
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
        return _decode(h) if h else None

    def _read_records(self, ids: list[str]) -> tuple[list[ReplicaRecord], list[str]]:
        """The records of `ids` in one round trip, and the ids whose record is gone."""
        pipe = self.r.pipeline(transaction=False)
        queue_records(pipe, ids)
        return take_records(ids, iter(pipe.execute()))

    def all_replicas(self) -> list[ReplicaRecord]:
        out, stale = self._read_records(sorted(self.r.smembers(keys.REPLICAS)))
        self.tidy_replica_ids(stale)
        return out

    def tidy_replica_ids(self, stale: Iterable[str]) -> None:
        """Drop ids from the set whose hash is gone (a reader found them)."""
        stale = list(stale)
        if stale:
            self.r.srem(keys.REPLICAS, *stale)

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
        names = sorted(set(want) | self.known_nodes())  # type: ignore[attr-defined]
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

        def txn(pipe: Pipeline) -> None:
            node, nodes = pipe.hmget(key, "node", "nodes")
            pipe.multi()
            pipe.delete(key, keys.load(replica_id))
            pipe.srem(keys.REPLICAS, replica_id)
            for n in _nodes_of(node, nodes):
                pipe.srem(keys.node_replicas(n), replica_id)

        self.r.transaction(txn, key)


def _queue_create(pipe: Pipeline, rec: ReplicaRecord) -> None:
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


def _decode(h: dict[str, str]) -> ReplicaRecord:
    return ReplicaRecord.from_dict({k: json.loads(v) for k, v in h.items()})


def _nodes_of(node_raw: str | None, nodes_raw: str | None) -> list[str]:
    """A stored record's nodes (head first) from its raw `node` and `nodes` fields."""
    try:
        nodes = json.loads(nodes_raw) if nodes_raw else []
        node = json.loads(node_raw) if node_raw else None
    except ValueError:
        return []
    return [n for n in (list(nodes or []) or ([node] if node else [])) if isinstance(n, str)]
