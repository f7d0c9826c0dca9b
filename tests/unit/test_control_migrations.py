"""One-time migrations (workers/control/migrations.py): each runs until its mark says done, then never
again; a failure is logged, never raised, and retried. fakeredis."""

from __future__ import annotations

import json
import logging

from llmgw.state import keys
from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store
from workers.control.migrations import MIGRATIONS, Migration, run_pending


def written_by_an_older_release(store: Store, rid: str, node: str) -> None:
    """The record and the id set only: no per-node index."""
    rec = ReplicaRecord(id=rid, model="m", profile="p", node=node, nodes=[node])
    store.r.hset(keys.replica(rid), mapping={k: json.dumps(v) for k, v in rec.to_dict().items()})
    store.r.sadd(keys.REPLICAS, rid)


def test_the_node_index_migration_indexes_old_records_once(store):
    written_by_an_older_release(store, "old", "a")
    assert [m.name for m in MIGRATIONS] == ["the per-node replica index"]
    assert run_pending(store) == ["the per-node replica index"]
    assert store.replica_node_index_ready()
    assert store.r.smembers(keys.node_replicas("a")) == {"old"}
    written_by_an_older_release(store, "later", "a")  # not indexed: the migration is done
    assert run_pending(store) == []
    assert store.r.smembers(keys.node_replicas("a")) == {"old"}


def test_a_failed_migration_is_logged_and_retried_and_the_others_still_run(store, caplog):
    attempts, ran = [], []

    def flaky(s: Store) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("redis went away")
        ran.append("flaky")

    migrations = (Migration("flaky", lambda s: "flaky" in ran, flaky, "the old way"),
                  Migration("steady", lambda s: "steady" in ran, lambda s: ran.append("steady"), "-"))
    with caplog.at_level(logging.ERROR, logger="llmgw.control"):
        assert run_pending(store, migrations) == ["steady"]
    assert any("migrating flaky failed" in r.getMessage() and "the old way" in r.getMessage()
               for r in caplog.records)
    assert run_pending(store, migrations) == ["flaky"]
    assert run_pending(store, migrations) == [] and len(attempts) == 2
