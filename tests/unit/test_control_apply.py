"""The reconcile pass's side effects on fakeredis with a fake dispatcher and a fake clock: intent is
recorded before every dispatch, a crash in between is repaired by the next pass, the lock prevents
overlapping passes, and housekeeping tidies what nobody else removes."""

from __future__ import annotations

import json
import logging

from llmgw.catalog import apply_catalog
from llmgw.state import keys
from llmgw.state.records import LoadRecord, ReplicaRecord
from llmgw.state.store import Store
from tests.support.clock import FakeClock
from tests.unit.control_support import catalog, cpu_profile, gpu_profile, model, node
from workers.control.apply import reconcile_once
from workers.control.housekeeping_pass import housekeeping_once
from workers.control.plan import PlanConfig
from workers.control.publish_pass import publish_once
from workers.control.snapshot import CatalogKeeper


class FakeDispatcher:
    """Records dispatches; checks at dispatch time that the intent is already in Redis."""

    def __init__(self, store: Store, fail_next: int = 0):
        self.store = store
        self.sent: list[tuple[str, str, str]] = []
        self.fail_next = fail_next

    def launch(self, replica_id: str, node: str) -> None:
        rec = self.store.get_replica(replica_id)
        assert rec is not None, "launch dispatched before the record exists"
        assert node in rec.nodes and rec.launch_dispatched_at is not None
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("broker went away")
        self.sent.append(("launch", replica_id, node))

    def stop(self, replica_id: str, node: str) -> None:
        rec = self.store.get_replica(replica_id)
        assert rec is not None and rec.stop_requested_at is not None, "stop dispatched before it was recorded"
        self.sent.append(("stop", replica_id, node))


def setup(store: Store, cat, *nodes, ttl=60.0):
    apply_catalog(store, cat, source="test", applied_by="test", now=0)
    for n in nodes:
        store.write_heartbeat(n, ttl=ttl)


def test_records_are_created_before_launches_are_dispatched(store):
    setup(store, catalog(model("m", gpu_profile(count=2, nodes=2))), node("a", "h100:2"), node("b", "h100:2"))
    d = FakeDispatcher(store)
    result = reconcile_once(store, d, FakeClock().time)
    assert result.applied == 1 and result.failed == 0
    (rec,) = store.all_replicas()
    assert rec.nodes == ["a", "b"] and rec.gpus == {"a": [0, 1], "b": [0, 1]}
    # A multi-node replica's launch goes to every one of its nodes.
    assert d.sent == [("launch", rec.id, "a"), ("launch", rec.id, "b")]
    # Control fields only: the agent's facts are untouched.
    raw = store.r.hgetall(keys.replica(rec.id))
    assert json.loads(raw["started_at"]) is None and json.loads(raw["url"]) is None


def test_a_crash_between_record_and_dispatch_is_repaired_by_a_later_pass(store):
    setup(store, catalog(model("m", cpu_profile())), node("a"))
    clock = FakeClock()
    d = FakeDispatcher(store, fail_next=1)
    result = reconcile_once(store, d, clock.time)
    assert result.failed == 1 and d.sent == []
    (rec,) = store.all_replicas()  # the intent survived the failed dispatch
    clock.t += 2
    reconcile_once(store, d, clock.time)
    assert d.sent == []  # not yet: the agent may simply be slow
    clock.t += 4
    reconcile_once(store, d, clock.time)
    assert d.sent == [("launch", rec.id, "a")]
    assert store.get_replica(rec.id).launch_dispatched_at == clock.t
    assert len(store.all_replicas()) == 1  # repaired, not duplicated


def test_stop_is_recorded_before_it_is_dispatched_and_stopped_records_are_deleted(store):
    setup(store, catalog(model("m", cpu_profile())), node("a"))
    clock = FakeClock()
    d = FakeDispatcher(store)
    reconcile_once(store, d, clock.time)
    (rec,) = store.all_replicas()
    apply_catalog(store, catalog(model("other", cpu_profile(replicas=0))), source="t", applied_by="t")
    clock.t += 1
    reconcile_once(store, d, clock.time)
    assert d.sent[-1] == ("stop", rec.id, "a")
    got = store.get_replica(rec.id)
    assert got.stop_requested_at == clock.t and got.stop_reason == 'model "m" left the catalog'
    store.update_replica(rec.id, stopped_at=clock.t + 1)  # what the agent reports
    clock.t += 2
    reconcile_once(store, d, clock.time)
    assert store.all_replicas() == []


def test_the_lock_prevents_overlapping_passes(store):
    setup(store, catalog(model("m", cpu_profile())), node("a"))
    d = FakeDispatcher(store)
    with store.lock(keys.RECONCILE_LOCK, 30) as held:
        assert held
        assert reconcile_once(store, d, FakeClock().time) is None
        assert store.all_replicas() == [] and d.sent == []
    assert reconcile_once(store, d, FakeClock().time) is not None
    assert len(store.all_replicas()) == 1
    assert store.r.get(keys.RECONCILE_LOCK) is None  # released after the pass


def test_catalog_sync_runs_first_and_its_failure_does_not_stop_the_pass(store):
    setup(store, catalog(model("m", cpu_profile())), node("a"))
    calls = []

    def sync():
        calls.append(1)
        raise OSError("catalog file unreadable")

    result = reconcile_once(store, FakeDispatcher(store), FakeClock().time, catalog_sync=sync)
    assert calls == [1] and result.applied == 1


def test_catalog_sync_applies_before_planning(store):
    setup(store, catalog(model("m", cpu_profile())), node("a"))

    def sync():
        apply_catalog(store, catalog(model("m", cpu_profile(replicas=3))), source="file", applied_by="t")

    reconcile_once(store, FakeDispatcher(store), FakeClock().time, catalog_sync=sync)
    assert len(store.all_replicas()) == 3


def test_lost_node_replica_is_replaced_then_stopped_without_a_dispatch(store):
    setup(store, catalog(model("m", cpu_profile())), node("a"), node("b"))
    clock = FakeClock()
    d = FakeDispatcher(store)
    reconcile_once(store, d, clock.time)
    (rec,) = store.all_replicas()
    store.r.delete(keys.node_heartbeat(rec.node))  # its heartbeat expired
    clock.t += 1
    reconcile_once(store, d, clock.time)
    recs = {r.id: r for r in store.all_replicas()}
    assert recs[rec.id].stop_requested_at is None  # kept while its replacement starts
    (new,) = [r for r in recs.values() if r.id != rec.id]
    assert new.node != rec.node
    store.update_replica(new.id, started_at=clock.t, first_ready_at=clock.t, last_probe_ok=True, url="http://x:1")
    clock.t += 1
    reconcile_once(store, d, clock.time)
    assert store.get_replica(rec.id).stop_requested_at == clock.t
    assert ("stop", rec.id, rec.node) not in d.sent  # nobody consumes a dead node's queue


def test_with_no_catalog_the_passes_do_nothing_and_say_why_once(store, caplog):
    # No catalog is not an empty one: Redis lost its data while engines run (their agents register
    # them again). Neither stop them nor publish an empty list over what the gateways route by.
    store.write_heartbeat(node("a"), ttl=60)
    store.create_replica(ReplicaRecord(id="r1", model="m", profile="p", node="a", nodes=["a"]))
    d, keeper = FakeDispatcher(store), CatalogKeeper()
    with caplog.at_level(logging.WARNING, logger="llmgw.control"):
        for t in (1.0, 2.0):
            assert reconcile_once(store, d, lambda: t, catalogs=keeper) is None
            assert publish_once(store, lambda: t, catalogs=keeper) is None
    assert store.get_replica("r1").stop_requested_at is None and not d.sent
    assert store.read_endpoints() == (0, "", [])
    said = [r.getMessage() for r in caplog.records if "no catalog" in r.getMessage()]
    assert len(said) == 1 and "llmgw catalog apply" in said[0]


def test_housekeeping_removes_stale_loads_and_forgets_nodes_long_gone(store):
    setup(store, catalog(model("m", cpu_profile())), node("a"), node("b"), node("gone"), node("flagged"),
          node("back"))
    reconcile_once(store, FakeDispatcher(store), FakeClock().time, config=PlanConfig())
    (rec,) = store.all_replicas()
    store.write_load(LoadRecord(replica_id=rec.id, ts=1.0, ok=True))
    store.write_load(LoadRecord(replica_id="deleted-replica", ts=1.0, ok=True))
    store.set_node_admin("flagged", cordoned=True)
    for n in ("gone", "flagged", "back", rec.node):
        store.r.delete(keys.node_heartbeat(n))
    store.wake_agent("gone", "x")
    assert housekeeping_once(store, 1000.0) == {"loads": 1, "nodes": 0}
    assert store.r.exists(keys.load(rec.id)) and not store.r.exists(keys.load("deleted-replica"))
    store.write_heartbeat(node("back"), ttl=60)  # returns before it is forgotten
    assert housekeeping_once(store, 1300.0)["nodes"] == 0  # gone for 300 s: still shown
    store.r.delete(keys.node_heartbeat("back"))
    assert housekeeping_once(store, 1700.0)["nodes"] == 1
    # Forgotten: gone (no heartbeat for 700 s, no replica, no flags). Kept: the flagged node, the
    # replica's node, and the one that came back (its clock restarted at 1700).
    assert store.known_nodes() == {"a", "b", "flagged", "back"}
    assert not store.r.exists(keys.agent_wake("gone"))
    assert set(store.r.hgetall(keys.NODES_MISSING_SINCE)) == {"flagged", rec.node, "back"}


def test_a_pass_that_runs_out_of_time_defers_the_rest_to_the_next(store):
    setup(store, catalog(model("m", cpu_profile(replicas=10))), node("a"), node("b"))
    ticks = iter(range(100))
    mono = lambda: float(next(ticks))  # noqa: E731 - each call is one second later
    clock = FakeClock()
    result = reconcile_once(store, FakeDispatcher(store), clock.time, lock_ttl=10.0, monotonic=mono)
    # started at 0; actions are applied while less than 5 s (half the lock TTL) have passed
    assert 0 < result.applied < 10 and result.applied + result.deferred == 10
    assert len(store.all_replicas()) == result.applied
    clock.t += 1
    reconcile_once(store, FakeDispatcher(store), clock.time)
    recs = store.all_replicas()
    assert len(recs) == 10 and sorted(r.node for r in recs) == ["a"] * 5 + ["b"] * 5


def test_the_task_binds_the_catalog_file_sync_only_when_a_file_is_configured(store, tmp_path):
    from llmgw.catalog import read_applied
    from llmgw.settings import ControlSettings
    from workers.control.tasks import _catalog_sync

    assert _catalog_sync(store, ControlSettings()) is None
    path = tmp_path / "catalog.yaml"
    path.write_text("models:\n  - name: m\n    profiles:\n      - {name: cpu, engine: sim, replicas: 1}\n")
    sync = _catalog_sync(store, ControlSettings(catalog_file=path))
    setup(store, catalog(), node("a"))
    reconcile_once(store, FakeDispatcher(store), FakeClock().time, catalog_sync=sync)
    version, cat, _meta = read_applied(store)
    assert cat.model("m") is not None and version == 2
    assert [r.model for r in store.all_replicas()] == ["m"]  # planned against the file's catalog


# --- the event history ------------------------------------------------------------------------------
def kinds_of(store: Store) -> list[tuple[str, str]]:
    return [(e.kind, e.replica or e.node) for e in store.latest_events(100)]


def test_a_pending_replica_records_who_refused_it_and_its_placement_is_an_event(store):
    setup(store, catalog(model("m", gpu_profile(count=2))), node("a", "h100:1"), node("c"))
    clock = FakeClock()
    reconcile_once(store, FakeDispatcher(store), clock.time)
    (rec,) = store.all_replicas()
    assert rec.pending_refusals == [
        {"why": "1 of 1 h100 free, needs 2", "nodes": ["a"], "count": 1},
        {"why": "has no h100 GPUs (it has no GPUs)", "nodes": ["c"], "count": 1},
    ]
    store.write_heartbeat(node("b", "h100:2"), ttl=60)
    clock.t += 1
    reconcile_once(store, FakeDispatcher(store), clock.time)
    placed = store.get_replica(rec.id)
    assert placed.node == "b" and placed.pending_refusals == [] and placed.pending_reason is None
    assert kinds_of(store)[-2:] == [("replica_pending", rec.id), ("replica_placed", rec.id)]


def test_moving_a_crash_looping_replica_is_an_event(store):
    setup(store, catalog(model("m", cpu_profile())), node("a"), node("b"))
    clock = FakeClock()
    reconcile_once(store, FakeDispatcher(store), clock.time)
    (rec,) = store.all_replicas()
    t = clock.t
    store.update_replica(rec.id, started_at=t - 50, exited_at=t - 1, exit_code=1, attempt=4,
                         failure_times=[t - 40, t - 30, t - 20, t - 1])
    clock.t += 1
    reconcile_once(store, FakeDispatcher(store), clock.time)
    new = next(r for r in store.all_replicas() if r.id != rec.id)
    (moved,) = [e for e in store.latest_events() if e.kind == "replica_moved"]
    assert moved.replica == rec.id and moved.data["new_replica"] == new.id and moved.node == new.node
    assert f"crash loop on {rec.node}" in moved.message


def test_a_node_loss_and_return_are_each_one_event_whoever_notices(store):
    from workers.control.publish_pass import PublishMemory, publish_once

    setup(store, catalog(model("m", cpu_profile())), node("a"), node("b"))
    mem1, mem2 = PublishMemory(), PublishMemory()  # two control workers
    for mem in (mem1, mem2):
        publish_once(store, lambda: 1000.0, memory=mem)
    store.r.delete(keys.node_heartbeat("b"))
    for mem in (mem1, mem2):
        publish_once(store, lambda: 1001.0, memory=mem)
    housekeeping_once(store, 1002.0)
    assert kinds_of(store)[-1:] == [("node_lost", "b")] and kinds_of(store).count(("node_lost", "b")) == 1
    store.write_heartbeat(node("b"), ttl=60)
    housekeeping_once(store, 1003.0)
    for mem in (mem1, mem2):
        publish_once(store, lambda: 1004.0, memory=mem)
    assert kinds_of(store).count(("node_joined", "b")) == 1
    assert store.nodes_missing_since() == {}
