"""GPU sharing by scheduling_priority: `choose_victims` tables over hand-built snapshots, and the plan
that drains the victims, waits for them, then places the waiting replica (tests/unit/control_support)."""

from __future__ import annotations

import pytest

from llmgw.state.node_records import NodeAdmin
from tests.unit.control_support import Sim, catalog, gpu_profile, model, node
from workers.control.placement import ClusterView, PlacementRequest
from workers.control.plan import CreateReplica, PlaceReplica, StopReplica, UpdatePending
from workers.control.preempt import Holder, Preemptor, choose_victims


def view_of(nodes: dict, holders: list[Holder], admin: dict | None = None) -> ClusterView:
    return ClusterView.build(nodes, admin or {}, [(h.model, h.id, {n: list(i) for n, i in h.gpus.items()})
                                                   for h in holders])


def h(rid, prio=0, gpus=None, load=0.0, stopping=False, model="low", profile="gpu") -> Holder:
    return Holder(rid, model, profile, prio, gpus or {"a": (0,)}, load, stopping)


def req(count=1, nodes=1, pool="default") -> PlacementRequest:
    return PlacementRequest("high", "gpu", pool=pool, gpu_class="h100", gpu_count=count, nodes=nodes)


ALL = {("low", "gpu"): 9, ("mid", "gpu"): 9}
A2 = {"a": node("a", "h100:2")}

# (id, nodes, holders, request, priority, budget, replicas to stop, replicas waited for)
CASES = [
    ("least-loaded-lower-one", A2, [h("r1", gpus={"a": (0,)}, load=3), h("r2", gpus={"a": (1,)}, load=1)],
     req(), 5, ALL, ["r2"], ["r2"]),
    ("lowest-priority-before-least-loaded", A2,
     [h("r1", prio=1, gpus={"a": (0,)}, load=0, model="mid"), h("r2", prio=0, gpus={"a": (1,)}, load=9)],
     req(), 5, ALL, ["r2"], ["r2"]),
    ("equal-priority-is-never-preempted", A2, [h("r1", prio=5, gpus={"a": (0, 1)})], req(), 5, ALL, None, None),
    ("higher-priority-is-never-preempted", A2, [h("r1", prio=7, gpus={"a": (0, 1)})], req(), 5, ALL, None, None),
    ("never-below-min", A2, [h("r1", gpus={"a": (0,)}), h("r2", gpus={"a": (1,)})], req(), 5,
     {("low", "gpu"): 0}, None, None),
    ("budget-of-one-takes-one", A2, [h("r1", gpus={"a": (0,)}), h("r2", gpus={"a": (1,)})], req(count=2), 5,
     {("low", "gpu"): 1}, None, None),
    ("a-replica-already-stopping-is-waited-for", A2,
     [h("r1", gpus={"a": (0,)}, stopping=True), h("r2", gpus={"a": (1,)})], req(), 5, ALL, [], ["r1"]),
    ("stopping-plus-one-victim", A2, [h("r1", gpus={"a": (0,)}, stopping=True), h("r2", gpus={"a": (1,)})],
     req(count=2), 5, ALL, ["r2"], ["r1", "r2"]),
    ("the-node-needing-fewest-victims", {"a": node("a", "h100:2"), "b": node("b", "h100:2")},
     [h("r1", gpus={"a": (0,)}), h("r2", gpus={"a": (1,)}), h("r3", gpus={"b": (0, 1)}, load=5)],
     req(count=2), 5, ALL, ["r3"], ["r3"]),
    ("a-free-gpu-plus-one-victim", A2, [h("r1", gpus={"a": (1,)})], req(count=2), 5, ALL, ["r1"], ["r1"]),
    ("other-pool-is-not-eligible", {"a": node("a", "h100:2", pool="other")}, [h("r1", gpus={"a": (0, 1)})],
     req(), 5, ALL, None, None),
    ("other-gpu-class-frees-nothing", {"a": node("a", "a10g:2")}, [h("r1", gpus={"a": (0, 1)})], req(), 5, ALL,
     None, None),
    ("multi-node-needs-room-on-two-nodes", {"a": node("a", "h100:1"), "b": node("b", "h100:1")},
     [h("r1", gpus={"a": (0,)}), h("r2", gpus={"b": (0,)}, load=2)], req(nodes=2), 5, ALL, ["r1", "r2"],
     ["r1", "r2"]),
]


@pytest.mark.parametrize("case_id,nodes,holders,want,priority,budget,stop,wait", CASES, ids=[c[0] for c in CASES])
def test_choose_victims(case_id, nodes, holders, want, priority, budget, stop, wait):
    room = choose_victims(want, priority, view_of(nodes, holders), holders, budget)
    if stop is None:
        assert room is None
        return
    assert room is not None
    assert sorted(v.id for v in room.stop) == stop
    assert sorted(v.id for v in room.wait_for) == wait


def test_a_cordoned_node_is_not_made_room_on():
    holders = [h("r1", gpus={"a": (0, 1)})]
    view = view_of(A2, holders, {"a": NodeAdmin(cordoned=True)})
    assert choose_victims(req(), 5, view, holders, ALL) is None


def test_the_reason_names_what_the_replica_waits_for():
    holders = [h("r3", prio=0, gpus={"a": (0, 1)}, model="b")]
    room = choose_victims(req(), 2, view_of(A2, holders), holders, {("b", "gpu"): 1})
    assert room.reason == "waiting for r3 (model b, scheduling_priority 0) to drain"


def test_a_pass_does_not_count_the_same_room_twice():
    holders = [h("r1", gpus={"a": (0,)}, stopping=True), h("r2", gpus={"a": (1,)})]
    view = view_of(A2, holders)
    pre = Preemptor(holders, ALL)
    first = pre.make_room(req(), 5, view)
    second = pre.make_room(req(), 5, view)
    assert [v.id for v in first.wait_for] == ["r1"] and not first.stop  # the stopping one covers the first
    assert [v.id for v in second.stop] == ["r2"]  # the second needs a victim of its own
    assert pre.make_room(req(), 5, view) is None  # nothing left


def test_free_gpus_counted_on_are_kept_from_others_in_the_pass():
    holders = [h("r1", gpus={"a": (1,)})]
    view = view_of(A2, holders)
    assert view.free_gpus("a", "h100") == 1
    room = Preemptor(holders, ALL).make_room(req(count=2), 5, view)
    assert room.reserved == (("a", (0,)),) and view.free_gpus("a", "h100") == 0


# --- the plan -----------------------------------------------------------------------------------------
def autoscaled(autoscale: dict, **kw) -> dict:
    p = gpu_profile(**kw)
    del p["replicas"]
    return {**p, "autoscale": autoscale}


def low(replicas=None):
    if replicas is not None:
        return model("low", gpu_profile(replicas=replicas, scheduling_priority=0))
    return model("low", autoscaled({"min": 0, "max": 2}, scheduling_priority=0))


def high(replicas=1, prio=5):
    return model("high", gpu_profile(replicas=replicas, scheduling_priority=prio))


def test_a_higher_scheduling_priority_preempts_drains_then_takes_the_gpu():
    sim = Sim(catalog(low()), {"a": node("a", "h100:1")}, wanted={("low", "gpu"): 1})
    sim.converge(2)
    (victim,) = sim.ready("low")
    sim.cat = catalog(low(), high())
    acts = sim.reconcile()
    (stop,) = [a for a in acts if isinstance(a, StopReplica)]
    assert stop.id == victim and stop.event == "replica_preempted"
    assert stop.reason == "preempted for high/gpu (scheduling_priority 5 > 0)"
    (create,) = [a for a in acts if isinstance(a, CreateReplica)]
    assert create.placement is None
    assert create.pending_reason == f"waiting for {victim} (model low, scheduling_priority 0) to drain"
    # While the victim drains, no further victims and the reason stands. The preempted profile wants its
    # replica back: it is Pending for lack of GPUs, and never preempts the higher one.
    sim.tick()
    acts = sim.reconcile()
    assert not [a for a in acts if isinstance(a, StopReplica)]
    assert not [a for a in acts if isinstance(a, UpdatePending) and a.id == create.id]
    low_pending = [r for r in sim.records.values() if r.model == "low" and r.stop_requested_at is None]
    assert [r.pending_reason for r in low_pending] == ['no node in pool "default" has 1 free h100 (free: a 0)']
    sim.agents()  # the victim drained and stopped
    sim.tick()
    acts = sim.reconcile()  # deletes its record; its GPU goes to the waiting replica, not back to low
    assert [a.id for a in acts if isinstance(a, PlaceReplica)] == [create.id]
    sim.converge(3)
    assert sim.ready("high") and not sim.ready("low")
    # The high one goes away (its autoscaler took it to zero, say): the low one returns.
    sim.cat = catalog(low())
    sim.converge(4)
    assert sim.ready("low") and not [r for r in sim.records.values() if r.model == "high"]


def test_a_fixed_profile_is_never_a_victim_and_equal_priority_waits():
    sim = Sim(catalog(low(replicas=1)), {"a": node("a", "h100:1")})
    sim.converge(2)
    sim.cat = catalog(low(replicas=1), high())
    acts = sim.reconcile()
    assert not [a for a in acts if isinstance(a, StopReplica)]
    sim = Sim(catalog(low()), {"a": node("a", "h100:1")}, wanted={("low", "gpu"): 1})
    sim.converge(2)
    sim.cat = catalog(low(), high(prio=0))
    assert not [a for a in sim.reconcile() if isinstance(a, StopReplica)]


def test_preemption_never_takes_an_autoscaled_profile_below_its_min():
    lowmin = model("low", autoscaled({"min": 1, "max": 3}, scheduling_priority=0))
    sim = Sim(catalog(lowmin), {"a": node("a", "h100:2")}, wanted={("low", "gpu"): 2})
    sim.converge(2)
    sim.cat = catalog(lowmin, high(replicas=2))
    acts = sim.reconcile()
    assert len([a for a in acts if isinstance(a, StopReplica)]) == 1  # 2 held, min 1: one may go
    pending = [a for a in acts if isinstance(a, CreateReplica)]
    assert [bool(a.pending_reason and a.pending_reason.startswith("waiting for")) for a in pending] == [True, False]


def test_higher_scheduling_priority_is_placed_first_when_gpus_are_short():
    cat = catalog(model("a", gpu_profile(replicas=1, priority=9)), model("b", gpu_profile(replicas=1, scheduling_priority=1)))
    sim = Sim(cat, {"n": node("n", "h100:1")})
    sim.reconcile()
    assert [r.model for r in sim.records.values() if r.node] == ["b"]


def test_scale_down_stops_the_least_loaded_replica():
    sim = Sim(catalog(model("m", autoscaled({"min": 1, "max": 3}))), {"a": node("a", "h100:3")},
              wanted={("m", "gpu"): 3})
    sim.converge(2)
    ids = sim.ready("m")
    sim.replica_load = {ids[0]: 4, ids[1]: 0, ids[2]: 7}
    sim.wanted = {("m", "gpu"): 2}
    (stop,) = [a for a in sim.reconcile() if isinstance(a, StopReplica)]
    assert stop.id == ids[1] and stop.reason == "scale down to 2"
