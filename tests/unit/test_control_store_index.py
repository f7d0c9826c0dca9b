"""The per-node replica index (`keys.node_replicas`), housekeeping's pure `forget`, the last good
catalog kept by a control worker, and beat's expiry options. fakeredis, fake clock."""

from __future__ import annotations

import json
import logging

import pytest

from llmgw.catalog import apply_catalog
from llmgw.settings import ControlSettings
from llmgw.state import keys
from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store
from tests.unit.control_support import catalog, cpu_profile, model, node
from workers.control.apply import reconcile_once
from workers.control.housekeeping import Forget, forget
from workers.control.housekeeping_pass import housekeeping_once
from workers.control.publish_pass import publish_once
from workers.control.snapshot import CatalogKeeper


class Dispatcher:
    def __init__(self):
        self.sent = []

    def launch(self, rid, node):
        self.sent.append(("launch", rid, node))

    def stop(self, rid, node):
        self.sent.append(("stop", rid, node))


def rec(rid: str, *nodes: str) -> ReplicaRecord:
    return ReplicaRecord(id=rid, model="m", profile="p", node=nodes[0] if nodes else None, nodes=list(nodes))


def members(store: Store, name: str) -> set[str]:
    return set(store.r.smembers(keys.node_replicas(name)))


# --- the per-node index -------------------------------------------------------------------------------
def test_create_place_and_delete_keep_the_node_index_in_step(store):
    store.create_replica(rec("multi", "a", "b"))
    store.create_replica(rec("pending"))
    assert members(store, "a") == {"multi"} and members(store, "b") == {"multi"}
    assert store.update_replica("pending", node="c", nodes=["c"], gpus={}, pending_reason=None)
    assert members(store, "c") == {"pending"}
    assert json.loads(store.r.hget(keys.replica("pending"), "node")) == "c"
    assert store.update_replica("gone", node="c", nodes=["c"]) is False  # no record: nothing written
    assert not store.r.exists(keys.replica("gone")) and members(store, "c") == {"pending"}
    store.delete_replica("multi")
    assert members(store, "a") == set() and members(store, "b") == set()
    assert store.r.smembers(keys.REPLICAS) == {"pending"}


def test_replicas_on_reads_only_the_nodes_own_records_once_the_index_is_complete(store):
    store.create_replica(rec("r1", "a"))
    store.create_replica(rec("r2", "b"))
    store.reindex_replica_nodes(store.all_replicas())
    # A record of another node that cannot even be decoded: a fleet-wide scan would trip on it.
    store.r.hset(keys.replica("broken"), mapping={"id": "{not json"})
    store.r.sadd(keys.REPLICAS, "broken")
    assert [r.id for r in store.replicas_on("a")] == ["r1"]
    assert store.replicas_on("idle") == []


def test_records_written_before_the_index_are_found_then_indexed(store):
    # The previous release wrote the record and the id set only.
    old = rec("old", "a")
    store.r.hset(keys.replica("old"), mapping={k: json.dumps(v) for k, v in old.to_dict().items()})
    store.r.sadd(keys.REPLICAS, "old")
    store.create_replica(rec("new", "a"))
    assert not store.replica_node_index_ready()
    assert sorted(r.id for r in store.replicas_on("a")) == ["new", "old"]  # full scan meanwhile
    # The next reconcile pass builds the index (and marks it complete).
    store.write_heartbeat(node("a"), ttl=60)
    apply_catalog(store, catalog(), source="t", applied_by="t", now=0)
    reconcile_once(store, Dispatcher(), lambda: 1000.0)
    assert store.replica_node_index_ready() and members(store, "a") == {"new", "old"}
    assert sorted(r.id for r in store.replicas_on("a")) == ["new", "old"]


def test_reindex_drops_ids_of_deleted_records_but_never_a_live_one(store):
    store.create_replica(rec("kept", "a"))
    store.r.sadd(keys.node_replicas("a"), "deleted-long-ago")
    snapshot = store.all_replicas()
    store.create_replica(rec("created-meanwhile", "a"))  # after the records were read
    store.reindex_replica_nodes(snapshot)
    assert members(store, "a") == {"kept", "created-meanwhile"}


# --- housekeeping's decision ------------------------------------------------------------------------
def test_forget_is_a_pure_decision():
    nodes = {"live": True, "new-gone": False, "old-gone": False, "used": False, "back": True}
    missing = {"old-gone": 100.0, "used": 100.0, "back": 500.0}
    got = forget(nodes, missing, referenced={"used"}, now=800.0, forget_after=600.0)
    assert got == Forget(first_missing={"new-gone": 800.0}, back=("back",), gone=("old-gone",))
    assert forget(nodes, missing, {"used"}, now=699.0, forget_after=600.0).gone == ()


def test_housekeeping_decides_over_one_view():
    """The records and operator flags keep a node; the replicas' and external urls' load samples stay;
    the index follows every record read."""
    from llmgw.state.node_records import NodeAdmin
    from llmgw.state.records import ExternalRecord
    from llmgw.state.views import HousekeepingView
    from workers.control.housekeeping import decide

    view = HousekeepingView(
        replicas=(rec("r1", "a", "held"),), externals=(ExternalRecord(id="x1", model="m", profile="p", url="http://x"),),
        known=frozenset({"a", "held", "flagged", "old-gone", "new-gone"}), live={"a": node("a")},
        admin={"flagged": NodeAdmin(cordoned=True), "old-gone": NodeAdmin()},
        missing_since={"held": 100.0, "flagged": 100.0, "old-gone": 100.0, "a": 50.0})
    d = decide(view, now=800.0, forget_after=600.0)
    assert d.keep_loads == ("r1", "x1") and d.index == view.replicas
    assert d.nodes == Forget(first_missing={"new-gone": 800.0}, back=("a",), gone=("old-gone",))


def test_housekeeping_reads_in_one_view(store, monkeypatch):
    """The pass reads through `housekeeping_view` alone (its write reads what writing needs)."""
    from llmgw.state.store import Store as StoreType

    views = []
    real = StoreType.housekeeping_view
    monkeypatch.setattr(store, "housekeeping_view", lambda: views.append(1) or real(store))
    for read in ("all_replicas", "external_records", "live_nodes", "all_node_admin", "nodes_missing_since",
                 "nodes_last_seen"):
        monkeypatch.setattr(store, read, lambda *a, _read=read: pytest.fail(f"housekeeping called {_read}"))
    store.write_heartbeat(node("x"), ttl=60)
    store.r.delete(keys.node_heartbeat("x"))
    housekeeping_once(store, 1000.0)
    assert views == [1] and store.r.hgetall(keys.NODES_MISSING_SINCE) == {"x": "1000.0"}


def test_housekeeping_forgets_every_trace_of_a_node(store):
    store.write_heartbeat(node("x"), ttl=60)
    store.r.hset(keys.NODES_LAST_SEEN, "x", "1.0")
    store.set_node_admin("x", cordoned=False, draining=False)  # uncordoned long ago: no intent left
    store.r.delete(keys.node_heartbeat("x"))
    housekeeping_once(store, 1000.0)
    assert housekeeping_once(store, 1700.0)["nodes"] == 1
    assert not store.known_nodes() and not store.r.hexists(keys.NODES_LAST_SEEN, "x")
    assert not store.r.exists(keys.node_admin("x"))


# --- the last good catalog --------------------------------------------------------------------------
def break_catalog(store: Store, version: int) -> None:
    doc = json.loads(store.r.get(keys.CATALOG))
    doc.update(version=version, hash=f"h{version}",
               spec={"models": [{"name": "m", "profiles": [{"name": "p", "engine": "future-engine"}]}]})
    store.r.set(keys.CATALOG, json.dumps(doc))


def test_an_unreadable_catalog_keeps_the_last_good_one_and_is_logged_once(store, caplog):
    store.write_heartbeat(node("a"), ttl=60)
    apply_catalog(store, catalog(model("m", cpu_profile(replicas=1))), source="t", applied_by="t", now=0)
    keeper = CatalogKeeper()
    reconcile_once(store, Dispatcher(), lambda: 1000.0, catalogs=keeper)
    assert len(store.all_replicas()) == 1
    break_catalog(store, 7)  # written by a newer CLI
    with caplog.at_level(logging.ERROR, logger="llmgw.control"):
        for t in (1002.0, 1004.0):
            result = reconcile_once(store, Dispatcher(), lambda: t, catalogs=keeper)
            assert result is not None and result.failed == 0
        publish_once(store, lambda: 1005.0, catalogs=keeper)
    assert len(store.all_replicas()) == 1 and store.all_replicas()[0].stop_requested_at is None
    errors = [r for r in caplog.records if "version 7" in r.getMessage()]
    assert len(errors) == 1 and "keeping version 1" in errors[0].getMessage()
    break_catalog(store, 8)
    with caplog.at_level(logging.ERROR, logger="llmgw.control"):
        reconcile_once(store, Dispatcher(), lambda: 1006.0, catalogs=keeper)
    assert any("version 8" in r.getMessage() for r in caplog.records)


def test_a_worker_that_never_read_a_good_catalog_does_nothing(store):
    store.write_heartbeat(node("a"), ttl=60)
    apply_catalog(store, catalog(model("m", cpu_profile(replicas=1))), source="t", applied_by="t", now=0)
    reconcile_once(store, Dispatcher(), lambda: 1000.0)
    break_catalog(store, 2)
    # A fresh worker must not read "no catalog" as "stop everything".
    assert reconcile_once(store, Dispatcher(), lambda: 1002.0, catalogs=CatalogKeeper()) is None
    assert store.all_replicas()[0].stop_requested_at is None
    assert publish_once(store, lambda: 1003.0, catalogs=CatalogKeeper()) is None


# --- beat -------------------------------------------------------------------------------------------
def test_every_beat_entry_expires_before_its_next_run():
    from beat.schedule import beat_schedule

    sched = beat_schedule(ControlSettings())
    assert set(sched) == {"reconcile", "publish", "housekeeping", "external", "batch-sweep"}
    for name, entry in sched.items():
        assert 0 < entry["options"]["expires"] < entry["schedule"]
        assert entry["options"]["queue"] == ("batch" if name == "batch-sweep" else "control")


def test_each_control_task_keeps_one_catalog_keeper_for_the_process():
    from workers.celery_app import create_celery_app

    app = create_celery_app(ControlSettings())
    import workers.control.tasks  # noqa: F401 - registers the tasks

    reconcile, publish = app.tasks["llmgw.reconcile"], app.tasks["llmgw.publish"]
    assert isinstance(reconcile.catalogs, CatalogKeeper) and reconcile.catalogs is reconcile.catalogs
    assert publish.catalogs is publish.catalogs
