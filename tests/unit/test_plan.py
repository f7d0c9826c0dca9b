"""The reconciler's plan, pass by pass, on an in-memory fleet with a fake clock (tests/unit/control_support)."""

from __future__ import annotations

import dataclasses
import logging

from llmgw.catalog import profile_spec_hash
from llmgw.state.node_records import NodeAdmin
from llmgw.state.replica_state import State
from tests.unit.control_support import (
    Sim,
    catalog,
    cpu_profile,
    gpu_profile,
    model,
    node,
    ready_record,
)
from workers.control.publish import LOST_GRACE
from workers.control.plan import (
    CreateReplica,
    DeleteRecord,
    DispatchLaunch,
    DispatchStop,
    PlanConfig,
    StopReplica,
    UpdatePending,
    plan,
)


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def test_starts_missing_replicas_and_records_gpus():
    sim = Sim(catalog(model("llama", gpu_profile(count=2, replicas=2))), {"a": node("a", "h100:4")})
    acts = sim.reconcile()
    creates = of(acts, CreateReplica)
    assert len(creates) == 2
    assert sorted(tuple(a.placement.gpus_dict()["a"]) for a in creates) == [(0, 1), (2, 3)]
    rec = sim.records[creates[0].id]
    assert rec.node == "a" and rec.nodes == ["a"] and rec.launch_dispatched_at == sim.now
    assert rec.spec_hash and rec.created_at == sim.now
    # Same facts, same decision: the pass is idempotent once its actions are recorded.
    assert sim.reconcile() == []


def test_plan_is_deterministic():
    cat = catalog(model("a", cpu_profile(replicas=3)), model("b", gpu_profile(replicas=2)))
    sim = Sim(cat, {"x": node("x", "h100:2"), "y": node("y")})
    assert plan(cat, sim.snapshot(), 5.0) == plan(cat, sim.snapshot(), 5.0)


def test_surplus_stops_not_ready_first_then_the_newest():
    sim = Sim(catalog(model("m", cpu_profile(replicas=1))), {"a": node("a"), "b": node("b"), "c": node("c")})
    now = sim.now
    sim.records = {
        "old-ready": ready_record("old-ready", "m", "cpu", "a", now),
        "new-ready": dataclasses.replace(ready_record("new-ready", "m", "cpu", "b", now), created_at=now - 10),
        "starting": dataclasses.replace(ready_record("starting", "m", "cpu", "c", now), first_ready_at=None),
    }
    h = profile_spec_hash(sim.cat.models[0], sim.cat.models[0].profiles[0])
    for rid in sim.records:
        sim.update(rid, spec_hash=h)
    stops = of(sim.reconcile(), StopReplica)
    assert [s.id for s in stops] == ["starting", "new-ready"]
    assert all(s.reason == "scale down to 1" and s.nodes for s in stops)


def test_scale_down_of_a_pending_replica_deletes_its_record():
    sim = Sim(catalog(model("m", gpu_profile(replicas=2))), {"a": node("a", "h100:1")})
    sim.reconcile()
    pending = [r for r in sim.records.values() if r.node is None]
    assert len(pending) == 1 and "has 1 free h100" in pending[0].pending_reason
    sim.cat = catalog(model("m", gpu_profile(replicas=1)))
    acts = sim.reconcile()
    assert of(acts, DeleteRecord) == [DeleteRecord(pending[0].id, "scale down to 1")]


def test_before_the_first_heartbeat_a_replica_waits_for_a_node_to_join():
    """A fleet starting (`llmgw up`): the catalog is applied before the node agent's first heartbeat.
    Its Pending reason says it waits for a node, not that the pool has none; once every node that had
    joined is gone, it says that no agent is live."""
    sim = Sim(catalog(model("m", cpu_profile(replicas=1))), {})
    (create,) = sim.reconcile()
    assert create.pending_reason == ('waiting for a node to join pool "default" (no node agent has sent its first '
                                     "heartbeat yet)")
    assert sim.reconcile() == []  # the same words every pass: nothing to write
    sim.nodes["a"] = node("a")
    assert kinds(sim.reconcile()) == ["PlaceReplica"]
    sim.lose("a")
    sim2 = Sim(catalog(model("m", cpu_profile(replicas=1))), {}, last_seen=dict(sim.last_seen))
    (create,) = sim2.reconcile()
    assert create.pending_reason == ('waiting for a node to join pool "default" (no node agent is live: none sent a '
                                     "heartbeat lately)")


def test_pending_replica_is_placed_when_a_node_joins_and_reason_updates():
    sim = Sim(catalog(model("m", gpu_profile(count=2))), {"a": node("a", "h100:1")})
    sim.reconcile()
    (rid,) = sim.records
    assert sim.state(rid) is State.PENDING
    assert sim.records[rid].pending_reason == 'no node in pool "default" has 2 free h100 (free: a 1)'
    assert sim.records[rid].pending_refusals == [{"why": "1 of 1 h100 free, needs 2", "nodes": ["a"], "count": 1}]
    assert sim.reconcile() == []  # same reason, same refusals: nothing to write
    sim.nodes["b"] = node("b", "a10g:2")
    (update,) = sim.reconcile()  # same reason, but one more node refused it
    assert isinstance(update, UpdatePending) and update.reason == sim.records[rid].pending_reason
    assert {n: r["why"] for r in sim.records[rid].pending_refusals for n in r["nodes"]} == {
        "a": "1 of 1 h100 free, needs 2", "b": "has no h100 GPUs (it has a10g)"}
    assert sim.reconcile() == []
    sim.nodes["d"] = node("d", "h100:1")
    (update,) = sim.reconcile()
    assert update.reason == 'no node in pool "default" has 2 free h100 (free: a 1, d 1)'
    assert sim.records[rid].pending_reason.endswith("(free: a 1, d 1)")
    sim.nodes["c"] = node("c", "h100:2")
    acts = sim.reconcile()
    assert kinds(acts) == ["PlaceReplica"]
    assert acts[0].placement.gpus_dict() == {"c": [0, 1]}
    assert sim.records[rid].node == "c" and sim.records[rid].pending_reason is None


def test_lost_node_replicas_are_replaced_at_once_and_stopped_once_the_replacement_is_ready():
    sim = Sim(catalog(model("m", cpu_profile(replicas=2))), {"a": node("a"), "b": node("b"), "c": node("c")})
    sim.converge(2)
    on_a = [i for i, r in sim.records.items() if r.node == "a"]
    assert len(on_a) == 1
    a_info = sim.lose("a")
    acts = sim.reconcile()
    (create,) = of(acts, CreateReplica)
    assert create.placement.nodes == ("c",)  # spread: c has none of the model
    # Replaced at once, but not asked to stop yet: a blip or an agent restart may still re-adopt it.
    assert not of(acts, StopReplica) and sim.records[on_a[0]].stop_requested_at is None
    assert sim.state(on_a[0]) is State.LOST
    sim.agents()  # the replacement turns Ready
    sim.tick()
    assert of(sim.reconcile(), StopReplica) == [
        StopReplica(on_a[0], "node a lost; replacement Ready", ("a",), dispatch=False, drain_timeout=120.0,
                    model="m")]
    # The node comes back: its stale engine is Stopping, the stop is re-sent, the agent stops it.
    sim.nodes["a"] = a_info
    sim.tick(11)
    assert sim.state(on_a[0]) is State.STOPPING
    assert DispatchStop(on_a[0], ("a",)) in sim.reconcile()
    sim.agents()
    assert sim.reconcile() == [DeleteRecord(on_a[0], "stopped")]
    assert len(sim.ready("m")) == 2


def test_a_node_back_within_the_grace_keeps_its_replicas_and_the_surplus_rule_settles():
    sim = Sim(catalog(model("m", cpu_profile(replicas=2))), {"a": node("a"), "b": node("b"), "c": node("c")})
    sim.converge(2)
    (on_a,) = [i for i, r in sim.records.items() if r.node == "a"]
    a_info = sim.lose("a")  # a heartbeat blip, or an agent restart slower than the TTL
    (create,) = of(sim.reconcile(), CreateReplica)
    sim.tick(5)
    sim.nodes["a"] = a_info  # back (its agent re-adopted the engine) before the replacement is Ready
    assert sim.state(on_a) is State.READY
    stops = of(sim.reconcile(), StopReplica)
    # One too many: the not-Ready (newest) replacement goes, the healthy engine on a stays.
    assert [(s.id, s.reason) for s in stops] == [(create.id, "scale down to 2")]
    sim.converge(2)
    assert on_a in sim.ready("m") and len(sim.ready("m")) == 2


def test_a_lost_replica_with_no_ready_replacement_is_stopped_after_the_grace():
    sim = Sim(catalog(model("m", gpu_profile())), {"a": node("a", "h100:1")})
    sim.converge(2)
    (rid,) = sim.records
    sim.lose("a")
    acts = sim.reconcile()
    (create,) = of(acts, CreateReplica)
    assert create.pending_reason and not of(acts, StopReplica)  # nowhere to go: Pending
    # The default grace is the one the publisher keeps a Lost node's Ready replicas routable for.
    assert PlanConfig().lost_grace == LOST_GRACE == 300.0
    sim.tick(299)
    assert not of(sim.reconcile(), StopReplica)
    sim.tick(1)
    assert of(sim.reconcile(), StopReplica) == [StopReplica(rid, "node a lost for 300s; replaced", ("a",),
                                                            dispatch=False, drain_timeout=120.0, model="m")]
    # A custom grace is honoured.
    sim2 = Sim(catalog(model("m", cpu_profile())), {"a": node("a")})
    sim2.converge(2)
    sim2.lose("a")
    sim2.tick(5)
    assert of(sim2.reconcile(config=PlanConfig(lost_grace=5.0)), StopReplica)


def test_the_grace_counts_from_the_last_heartbeat_or_the_records_last_fact():
    sim = Sim(catalog(model("m", cpu_profile())), {"a": node("a"), "b": node("b")})
    sim.converge(2)
    (rid,) = sim.records
    home = sim.records[rid].node
    sim.nodes.pop(home)  # no heartbeat time known: the record's latest fact (its last probe) counts
    last_probe = sim.records[rid].last_probe_at
    sim.now = last_probe + 59
    assert not of(sim.reconcile(config=PlanConfig(lost_grace=60.0)), StopReplica)
    sim.now = last_probe + 61
    assert [s.id for s in of(sim.reconcile(config=PlanConfig(lost_grace=60.0)), StopReplica)] == [rid]


def test_lost_replica_asked_to_stop_is_deleted_after_a_grace():
    sim = Sim(catalog(model("m", cpu_profile(replicas=1))), {"a": node("a"), "b": node("b")})
    sim.converge(2)
    (rid,) = sim.records
    sim.lose(sim.records[rid].node)
    sim.reconcile()
    sim.agents()  # the replacement is Ready: the Lost one is asked to stop
    sim.tick()
    assert of(sim.reconcile(), StopReplica)
    sim.tick(30)
    assert not of(sim.reconcile(), DeleteRecord)
    sim.tick(31)
    assert DeleteRecord(rid, "stop unconfirmed: node gone") in sim.reconcile()


def crash_loop(sim: Sim, rid: str) -> None:
    now = sim.now
    sim.update(rid, exited_at=now, exit_code=1, failure_times=[now - 30, now - 20, now - 10, now - 1],
               first_ready_at=None, last_probe_ok=False)


def test_failed_replica_is_left_to_the_agent():
    sim = Sim(catalog(model("m", gpu_profile())), {"a": node("a", "h100:1"), "b": node("b", "h100:1")})
    sim.converge(2)
    (rid,) = sim.records
    sim.update(rid, exited_at=sim.now, exit_code=1, failure_times=[sim.now])
    assert sim.state(rid) is State.FAILED
    assert sim.reconcile() == []


def test_crash_loop_moves_to_another_node_when_one_can_take_it():
    sim = Sim(catalog(model("m", gpu_profile())), {"a": node("a", "h100:1")})
    sim.converge(2)
    (rid,) = sim.records
    crash_loop(sim, rid)
    assert sim.state(rid) is State.CRASHLOOP
    assert sim.reconcile() == []  # nowhere else to go: the agent keeps retrying with backoff
    sim.nodes["b"] = node("b", "h100:1")
    acts = sim.reconcile()
    (create,) = of(acts, CreateReplica)
    (stop,) = of(acts, StopReplica)
    assert create.placement.nodes == ("b",)
    assert stop.id == rid and stop.reason == f"crash loop on a; moved to b as {create.id}"


def run_with_slow_agents(sim: Sim, passes: int, ready_after: float = 4.0) -> list[int]:
    """Reconcile `passes` times; agents start replicas at once but they turn Ready only
    `ready_after` seconds later. Returns the Ready count of every model after each pass."""
    readies = []
    for _ in range(passes):
        sim.reconcile()
        sim.agents(ready=False)
        for rid, rec in sim.records.items():
            if rec.running and rec.first_ready_at is None and sim.now - rec.started_at >= ready_after:
                sim.update(rid, first_ready_at=sim.now, last_probe_ok=True, last_probe_at=sim.now)
        readies.append(len(sim.ready()))
        sim.tick(2)
    return readies


def test_rolling_update_never_drops_ready_and_surges_by_one():
    nodes = {n: node(n, "h100:2") for n in "abc"}
    sim = Sim(catalog(model("m", gpu_profile(replicas=3))), nodes)
    sim.converge(3)
    old_ids = set(sim.ready("m"))
    assert len(old_ids) == 3
    sim.cat = catalog(model("m", gpu_profile(replicas=3, args=["--max-model-len", "4096"])))
    max_live = 0
    readies = []
    for _ in range(20):
        readies += run_with_slow_agents(sim, 1)
        live = [i for i in sim.records if sim.state(i) not in (State.STOPPED, State.STOPPING)]
        max_live = max(max_live, len(live))
    assert min(readies) >= 3, readies  # capacity allowed it: never below the wanted count
    assert max_live <= 4  # a surge of one
    assert not old_ids & set(sim.records)
    assert len(sim.ready("m")) == 3


def test_a_rolling_stop_and_the_next_surge_replica_are_one_pass():
    """The pass that stops an old replica (its replacement is Ready) also starts the next new one:
    the surge counts the old replicas left after its stops, as the pass after it would."""
    nodes = {n: node(n, "h100:2") for n in "abc"}
    sim = Sim(catalog(model("m", gpu_profile(replicas=2))), nodes)
    sim.converge(3)
    sim.cat = catalog(model("m", gpu_profile(replicas=2, args=["--enforce-eager"])))
    first = sim.reconcile()  # one surge replica, nothing stopped yet
    assert [type(a).__name__ for a in first].count("CreateReplica") == 1
    sim.agents()
    sim.tick()
    second = sim.reconcile()
    kinds = [type(a).__name__ for a in second]
    assert kinds.count("StopReplica") == 1 and kinds.count("CreateReplica") == 1, kinds
    assert sim.reconcile() == []  # and the pass after it has nothing left to decide


def test_rolling_update_with_no_spare_capacity_keeps_one_ready():
    # Two replicas, room for exactly two: the surge replica cannot be placed until an old one goes,
    # and one old one may go only while another replica stays Ready.
    sim = Sim(catalog(model("m", gpu_profile(replicas=2))), {"a": node("a", "h100:2")})
    sim.converge(3)
    sim.cat = catalog(model("m", gpu_profile(replicas=2, args=["--enforce-eager"])))
    readies = run_with_slow_agents(sim, 25)
    assert min(readies) >= 1, readies
    assert len(sim.ready("m")) == 2
    h = profile_spec_hash(sim.cat.models[0], sim.cat.models[0].profiles[0])
    assert {sim.records[i].spec_hash for i in sim.ready("m")} == {h}


def test_rolling_update_of_a_single_replica_without_room_never_stops_the_old_one():
    sim = Sim(catalog(model("m", gpu_profile(replicas=1))), {"a": node("a", "h100:1")})
    sim.converge(2)
    (old,) = sim.records
    sim.cat = catalog(model("m", gpu_profile(replicas=1, args=["--enforce-eager"])))
    for _ in range(5):
        sim.converge(1)
    assert sim.ready("m") == [old]
    pending = [r for r in sim.records.values() if r.node is None]
    assert len(pending) == 1 and "free h100" in pending[0].pending_reason


def test_drain_moves_replicas_new_ready_first():
    nodes = {"a": node("a"), "b": node("b"), "c": node("c")}
    sim = Sim(catalog(model("m", cpu_profile(replicas=2))), nodes)
    sim.converge(2)
    on_a = [i for i, r in sim.records.items() if r.node == "a"]
    assert on_a
    sim.admin["a"] = NodeAdmin(cordoned=True, draining=True)
    readies = run_with_slow_agents(sim, 8)
    assert min(readies) >= 2, readies
    assert not any(r.node == "a" for r in sim.records.values())
    stops = [a for acts in sim.history for a in of(acts, StopReplica)]
    assert [s.id for s in stops] == on_a and stops[0].reason == "replaced: node a is draining"


def test_cordon_keeps_running_replicas_but_places_nothing_new():
    sim = Sim(catalog(model("m", cpu_profile(replicas=1))), {"a": node("a"), "b": node("b")})
    sim.converge(2)
    (rid,) = sim.records
    home = sim.records[rid].node
    sim.admin[home] = NodeAdmin(cordoned=True)
    assert sim.reconcile() == []
    sim.cat = catalog(model("m", cpu_profile(replicas=3)))
    acts = sim.reconcile()
    assert all(a.placement.nodes != (home,) for a in of(acts, CreateReplica))


def test_model_removed_from_catalog_is_stopped_then_deleted():
    sim = Sim(catalog(model("m", cpu_profile(replicas=2)), model("keep", cpu_profile())), {"a": node("a")})
    sim.converge(2)
    sim.cat = catalog(model("keep", cpu_profile()))
    acts = sim.reconcile()
    stops = of(acts, StopReplica)
    assert len(stops) == 2 and all(s.reason == 'model "m" left the catalog' for s in stops)
    assert not of(sim.reconcile(), StopReplica)  # recorded once, not again
    sim.agents()
    assert len(of(sim.reconcile(), DeleteRecord)) == 2
    assert {r.model for r in sim.records.values()} == {"keep"}


def test_removed_profile_is_stopped():
    sim = Sim(catalog(model("m", cpu_profile("a"), cpu_profile("b"))), {"x": node("x")})
    sim.converge(2)
    sim.cat = catalog(model("m", cpu_profile("a")))
    stops = of(sim.reconcile(), StopReplica)
    assert [s.reason for s in stops] == ['profile "b" left model "m"']


def test_higher_priority_is_placed_first_and_nothing_running_is_evicted():
    cat = catalog(model("low", gpu_profile(replicas=2, priority=0)), model("high", gpu_profile(replicas=2, priority=5)))
    sim = Sim(cat, {"a": node("a", "h100:3")})
    sim.reconcile()
    placed = sorted(r.model for r in sim.records.values() if r.node)
    assert placed == ["high", "high", "low"]
    sim.converge(2)
    # Another high-priority replica is wanted: it stays Pending; the running low one is not evicted.
    sim.cat = catalog(model("low", gpu_profile(replicas=2, priority=0)), model("high", gpu_profile(replicas=3, priority=5)))
    acts = sim.reconcile()
    assert not of(acts, StopReplica)
    assert [a.pending_reason for a in of(acts, CreateReplica)] == ['no node in pool "default" has 1 free h100 (free: a 0)']


def test_launch_is_redispatched_while_the_agent_has_not_started_it():
    sim = Sim(catalog(model("m", cpu_profile())), {"a": node("a")})
    sim.reconcile()
    (rid,) = sim.records
    sim.tick(4)
    assert sim.reconcile() == []
    sim.tick(2)
    assert sim.reconcile() == [DispatchLaunch(rid, ("a",))]


def test_stop_is_redispatched_while_unconfirmed():
    sim = Sim(catalog(model("m", cpu_profile())), {"a": node("a")})
    sim.converge(2)
    sim.cat = catalog()
    sim.reconcile()
    (rid,) = sim.records
    sim.tick(5)
    assert sim.reconcile() == []
    sim.tick(6)
    assert sim.reconcile() == [DispatchStop(rid, ("a",))]


def test_multi_node_replica_records_every_node_and_is_lost_with_any():
    cat = catalog(model("big", gpu_profile(count=4, nodes=2)))
    sim = Sim(cat, {n: node(n, "h100:4") for n in "abc"})
    sim.converge(2)
    (rid,) = sim.records
    rec = sim.records[rid]
    assert rec.nodes == ["a", "b"] and rec.node == "a" and rec.gpus == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    sim.lose("b")
    acts = sim.reconcile()
    assert not of(acts, StopReplica)  # kept until a replacement is Ready or the grace ends
    (create,) = of(acts, CreateReplica)
    # c is the only node with free GPUs now; a's GPUs stay with the Lost replica until it stops.
    assert create.pending_reason and "1 have them" in create.pending_reason


def test_one_bad_record_is_skipped_and_the_pass_goes_on(caplog):
    sim = Sim(catalog(model("m", cpu_profile(replicas=1)), model("n", cpu_profile())), {"a": node("a")})
    sim.records["bad"] = dataclasses.replace(ready_record("bad", "m", "cpu", "a", sim.now), failure_times=None,
                                             first_ready_at=None, started_at=None)
    with caplog.at_level(logging.ERROR, logger="llmgw.control.plan"):
        acts = sim.reconcile()
    assert "skipping replica bad" in caplog.text
    assert {a.model for a in of(acts, CreateReplica)} == {"m", "n"}


def test_plan_config_knobs_are_honoured():
    sim = Sim(catalog(model("m", cpu_profile())), {"a": node("a")})
    sim.reconcile(config=PlanConfig(launch_redispatch_after=1.0))
    sim.tick(1)
    assert kinds(sim.reconcile(config=PlanConfig(launch_redispatch_after=1.0))) == ["DispatchLaunch"]


def test_a_new_spec_that_crash_loops_never_replaces_the_old_replicas():
    sim = Sim(catalog(model("m", cpu_profile(replicas=2))), {"a": node("a"), "b": node("b")})
    sim.converge(2)
    old = set(sim.ready("m"))
    sim.cat = catalog(model("m", cpu_profile(replicas=2, args=["--fail-start"])))
    for _ in range(10):
        sim.reconcile()
        sim.agents(ready=False)
        for rid, rec in list(sim.records.items()):
            if rid not in old and rec.stop_requested_at is None and rec.node:
                crash_loop(sim, rid)
        sim.tick()
    assert set(sim.ready("m")) == old
    live_new = [i for i, r in sim.records.items() if i not in old and r.stop_requested_at is None]
    assert len(live_new) == 1  # still a surge of one, moved between nodes, never more


def test_rolling_update_to_a_spec_no_node_can_take_keeps_every_old_replica():
    sim = Sim(catalog(model("m", gpu_profile(replicas=2))), {"a": node("a", "h100:2")})
    sim.converge(3)
    old = set(sim.ready("m"))
    sim.cat = catalog(model("m", gpu_profile(replicas=2, node_selector={"zone": "nowhere"})))
    for _ in range(6):
        sim.converge(1)
    assert set(sim.ready("m")) == old  # stopping one would free nothing the new spec can use
    pending = [r for r in sim.records.values() if r.node is None]
    assert len(pending) == 1 and "matches node_selector" in pending[0].pending_reason


def test_drain_without_room_elsewhere_waits_instead_of_stopping():
    sim = Sim(catalog(model("m", gpu_profile(replicas=2))), {"a": node("a", "h100:1"), "b": node("b", "h100:1")})
    sim.converge(3)
    sim.admin["a"] = NodeAdmin(cordoned=True, draining=True)
    for _ in range(5):
        sim.converge(1)
    assert len(sim.ready("m")) == 2
    sim.nodes["c"] = node("c", "h100:1")
    sim.converge(4)
    assert len(sim.ready("m")) == 2 and not any(r.node == "a" for r in sim.records.values())


def test_gpus_of_a_record_that_cannot_be_read_are_never_handed_out_again(caplog):
    sim = Sim(catalog(model("m", gpu_profile(replicas=1))), {"a": node("a", "h100:2")})
    sim.records["bad"] = dataclasses.replace(ready_record("bad", "m", "gpu", "a", sim.now, gpus={"a": [0]}),
                                             failure_times=None, started_at=None)
    with caplog.at_level(logging.ERROR, logger="llmgw.control.plan"):
        (create,) = of(sim.reconcile(), CreateReplica)
    assert create.placement.gpus_dict() == {"a": [1]}


def test_routing_only_edits_roll_nothing_and_launch_edits_do():
    base = dict(replicas=2, start_timeout=120)
    sim = Sim(catalog(model("m", cpu_profile(**base))), {"a": node("a", labels={"zone": "x"}), "b": node("b")})
    sim.converge(3)
    ready = set(sim.ready("m"))
    for edit in ({"start_timeout": 30}, {"priority": 7}, {"weight": 3.0},
                 {"metrics": {"running": "my_running"}}, {"node_selector": {}}):
        sim.cat = catalog(model("m", cpu_profile(**{**base, **edit})))
        acts = sim.reconcile()
        assert acts == [], (edit, acts)
    sim.cat = catalog(model("m", cpu_profile(**{**base, "args": ["--startup-delay", "1"]})))
    acts = sim.reconcile()
    assert [a.why for a in of(acts, CreateReplica)] == ["rolling replacement (spec changed)"]
    assert set(sim.ready("m")) == ready  # nothing stopped before the new one is Ready


def test_records_hashed_before_the_narrower_spec_hash_are_current():
    from workers.control.plan import legacy_spec_hash

    sim = Sim(catalog(model("m", cpu_profile())), {"a": node("a")})
    sim.converge(2)
    (rid,) = sim.records
    m = sim.cat.models[0]
    sim.update(rid, spec_hash=legacy_spec_hash(m, m.profiles[0]))  # written by the previous release
    assert sim.reconcile() == []  # upgrading llmgw does not restart the fleet
    sim.cat = catalog(model("m", cpu_profile(args=["--startup-delay", "1"])))
    assert of(sim.reconcile(), CreateReplica)
