"""Placement: table-driven cases for the rules in docs/control-plane.md."""

from __future__ import annotations

import pytest

from llmgw.state.node_records import NodeAdmin
from tests.unit.control_support import node
from workers.control.placement import (
    ClusterView,
    NoPlacement,
    Placement,
    PlacementRequest,
    place,
    Refusal,
    place_and_allocate,
    spread_many,
)


def gpu_req(count=1, cls="h100", pool="default", nodes=1, selector=(), exclude=(), model="m"):
    return PlacementRequest(model=model, profile="p", pool=pool, selector=tuple(selector), gpu_class=cls,
                            gpu_count=count, nodes=nodes, exclude=frozenset(exclude))


def cpu_req(model="m", pool="default", selector=(), exclude=()):
    return PlacementRequest(model=model, profile="p", pool=pool, selector=tuple(selector),
                            exclude=frozenset(exclude))


def view(*nodes, admin=None, allocated=(), active=()):
    return ClusterView.build({n.name: n for n in nodes}, admin or {}, allocated, active)


CASES = [
    # (name, nodes, admin, allocated, request, expected nodes, expected gpus per node)
    (
        "bin-pack: the tightest node that fits, not the emptiest",
        [node("big", "h100:8"), node("small", "h100:2")], {}, [],
        gpu_req(2), ("small",), {"small": [0, 1]},
    ),
    (
        "bin-pack: a node partly used fits tighter than an empty one",
        [node("a", "h100:4"), node("b", "h100:4")], {}, [("x", "r1", {"b": [0, 1]})],
        gpu_req(1), ("b",), {"b": [2]},
    ),
    (
        "bin-pack: skips nodes that cannot hold the whole request",
        [node("a", "h100:1"), node("b", "h100:4")], {}, [],
        gpu_req(2), ("b",), {"b": [0, 1]},
    ),
    (
        "ties broken by name",
        [node("b", "h100:2"), node("a", "h100:2")], {}, [],
        gpu_req(1), ("a",), {"a": [0]},
    ),
    (
        "mixed classes on one node: only the requested class counts",
        [node("mix", "a10g:1,l4:2"), node("l4only", "l4:4")], {}, [],
        gpu_req(2, cls="l4"), ("mix",), {"mix": [1, 2]},
    ),
    (
        "pool restricts",
        [node("a", "h100:1"), node("b", "h100:8", pool="gpu")], {}, [],
        gpu_req(1, pool="gpu"), ("b",), {"b": [0]},
    ),
    (
        "labels restrict",
        [node("a", "h100:1", labels={"zone": "x"}), node("b", "h100:8", labels={"zone": "y"})], {}, [],
        gpu_req(1, selector=[("zone", "y")]), ("b",), {"b": [0]},
    ),
    (
        "cordoned and draining nodes get nothing new",
        [node("a", "h100:1"), node("b", "h100:1"), node("c", "h100:8")],
        {"a": NodeAdmin(cordoned=True), "b": NodeAdmin(draining=True)}, [],
        gpu_req(1), ("c",), {"c": [0]},
    ),
    (
        "multi-node: N distinct nodes of the pool, each with the full request, tightest first",
        [node("a", "h100:8", pool="gpu"), node("b", "h100:4", pool="gpu"), node("c", "h100:4", pool="gpu"),
         node("d", "h100:8")], {}, [],
        gpu_req(4, pool="gpu", nodes=2), ("b", "c"), {"b": [0, 1, 2, 3], "c": [0, 1, 2, 3]},
    ),
    (
        "allocated GPUs are never handed out again",
        [node("a", "h100:4")], {}, [("x", "r1", {"a": [0, 2]})],
        gpu_req(2), ("a",), {"a": [1, 3]},
    ),
    (
        "exclusion (a crash-looping replica's home) is honoured",
        [node("a", "h100:1"), node("b", "h100:2")], {}, [],
        gpu_req(1, exclude=["a"]), ("b",), {"b": [0]},
    ),
    (
        "CPU: spread to the node with the fewest replicas of the model",
        [node("a"), node("b")], {}, [],
        cpu_req(), ("a",), {},
    ),
]


@pytest.mark.parametrize("name,nodes,admin,allocated,req,want_nodes,want_gpus", CASES, ids=[c[0] for c in CASES])
def test_place(name, nodes, admin, allocated, req, want_nodes, want_gpus):
    v = view(*nodes, admin=admin, allocated=allocated)
    got = place(req, v)
    assert isinstance(got, Placement), got
    assert got.nodes == want_nodes
    assert got.gpus_dict() == want_gpus
    assert place(req, v) == got  # `place` does not change the view


UNSCHEDULABLE = [
    (
        "not enough free GPUs: says how many each node has",
        [node("node-a", "h100:1", pool="gpu"), node("node-b", "h100:2", pool="gpu")],
        {}, [("x", "r1", {"node-b": [0, 1]})],
        gpu_req(2, pool="gpu"),
        'no node in pool "gpu" has 2 free h100 (free: node-a 1, node-b 0)',
    ),
    (
        "wrong class",
        [node("a", "a10g:4")], {}, [], gpu_req(1, cls="h100"),
        'no node in pool "default" has h100 GPUs (it has: a10g)',
    ),
    (
        "no GPUs at all",
        [node("a")], {}, [], gpu_req(1),
        'no node in pool "default" has h100 GPUs (it has no GPUs)',
    ),
    (
        "empty pool",
        [node("a", "h100:1")], {}, [], gpu_req(1, pool="gpu"),
        'no schedulable node in pool "gpu" (no live node in it)',
    ),
    (
        "no node has joined yet",  # a fleet starting: before the first heartbeat
        [], {}, [], gpu_req(1, pool="gpu"),
        'waiting for a node to join pool "gpu" (no node agent has sent its first heartbeat yet)',
    ),
    (
        "every node of the pool cordoned",
        [node("a", "h100:1"), node("b", "h100:1")], {"a": NodeAdmin(cordoned=True), "b": NodeAdmin(draining=True)},
        [], gpu_req(1),
        'no schedulable node in pool "default"; not schedulable: a cordoned, b draining',
    ),
    (
        "selector matches nothing",
        [node("a", "h100:1", labels={"zone": "x"})], {}, [], gpu_req(1, selector=[("zone", "y")]),
        'no node in pool "default" matches node_selector {zone=y}',
    ),
    (
        "multi-node: not enough nodes with the full request",
        [node("a", "h100:8"), node("b", "h100:4")], {}, [], gpu_req(8, nodes=2),
        'needs 2 nodes in pool "default" with 8 free h100 each, 1 have them (free: a 8, b 4)',
    ),
    (
        "CPU, nowhere but the excluded node",
        [node("a")], {}, [], cpu_req(exclude=["a"]),
        'no node in pool "default" other than a',
    ),
]


@pytest.mark.parametrize("name,nodes,admin,allocated,req,reason", UNSCHEDULABLE, ids=[c[0] for c in UNSCHEDULABLE])
def test_unschedulable_reasons(name, nodes, admin, allocated, req, reason):
    got = place(req, view(*nodes, admin=admin, allocated=allocated))
    assert isinstance(got, NoPlacement) and got.reason == reason


def test_reason_lists_at_most_eight_nodes():
    nodes = [node(f"n{i:02d}", "h100:1") for i in range(12)]
    got = place(gpu_req(2), view(*nodes))
    assert isinstance(got, NoPlacement)
    assert got.reason.endswith("n07 1, and 4 more)")


def test_bin_packing_keeps_a_whole_node_free_for_a_big_replica():
    v = view(node("a", "h100:8"), node("b", "h100:8"))
    for _ in range(4):
        assert place_and_allocate(gpu_req(2), v).nodes == ("a",)
    # a is full; b is still whole, so an 8-GPU replica fits.
    assert place_and_allocate(gpu_req(8), v).gpus_dict() == {"b": list(range(8))}
    assert isinstance(place_and_allocate(gpu_req(1), v), NoPlacement)


def test_cpu_spread_counts_other_models_as_a_tie_breaker():
    v = view(node("a"), node("b"), node("c"), active=[("other", ("a",)), ("other", ("b",))])
    assert place(cpu_req(), v).nodes == ("c",)
    v = view(node("a"), node("b"), active=[("m", ("b",)), ("other", ("a",)), ("other", ("a",))])
    # Fewest of this model wins over fewest overall.
    assert place(cpu_req(), v).nodes == ("a",)


def test_cpu_spread_many_is_even():
    v = view(node("a"), node("b"), node("c"))
    placed, missing = spread_many(cpu_req(), v, 7)
    assert missing is None
    counts = {n: sum(1 for p in placed if p.nodes == (n,)) for n in "abc"}
    assert counts == {"a": 3, "b": 2, "c": 2}


def test_cpu_spread_many_with_no_eligible_node_says_why():
    placed, missing = spread_many(cpu_req(selector=[("zone", "q")]), view(node("a")), 3)
    assert placed == []
    assert missing.reason == 'no node in pool "default" matches node_selector {zone=q}'
    assert missing.refusals == (Refusal("no label zone (wants zone=q)", ("a",), 1),)


def test_gpu_class_names_are_normalised_on_both_sides():
    # A node reporting the nvidia-smi name still matches a catalog's short class.
    from llmgw.state.node_records import GPUDevice, NodeInfo

    n = NodeInfo(name="a", gpus=(GPUDevice(0, "NVIDIA H100 80GB HBM3"),))
    got = place(gpu_req(1, cls="h100"), ClusterView.build({"a": n}, {}))
    assert isinstance(got, Placement) and got.gpus_dict() == {"a": [0]}


def test_no_placement_says_why_each_live_node_refused():
    nodes = [node("big", "h100:4"), node("cpu1"), node("cpu2"), node("l4", "l4:2"),
             node("other", "h100:8", pool="batch"), node("cord", "h100:8"), node("zone", "h100:8", labels={"z": "b"})]
    got = place(gpu_req(2, selector=[("z", "a")]), view(*nodes, admin={"cord": NodeAdmin(cordoned=True)},
                                                        allocated=[("x", "r1", {"big": [0, 1, 2]})]))
    assert isinstance(got, NoPlacement)
    # Grouped by why, most nodes first; each node once, with the first rule it fails.
    assert [r.to_dict() for r in got.refusals] == [
        {"why": "no label z (wants z=a)", "nodes": ["big", "cpu1", "cpu2", "l4"], "count": 4},
        {"why": "cordoned", "nodes": ["cord"], "count": 1},
        {"why": 'in pool "batch", not "default"', "nodes": ["other"], "count": 1},
        {"why": "label z=b, not a", "nodes": ["zone"], "count": 1},
    ]
    # Without the selector, capacity and class are what refuse.
    got = place(gpu_req(2), view(*nodes[:4], allocated=[("x", "r1", {"big": [0, 1, 2]})]))
    assert {n: r.why for r in got.refusals for n in r.nodes} == {
        "big": "1 of 4 h100 free, needs 2", "cpu1": "has no h100 GPUs (it has no GPUs)",
        "cpu2": "has no h100 GPUs (it has no GPUs)", "l4": "has no h100 GPUs (it has l4)"}
    assert got.refusals[0] == Refusal("has no h100 GPUs (it has no GPUs)", ("cpu1", "cpu2"), 2)


def test_refusals_name_a_few_nodes_and_count_them_all():
    got = place(gpu_req(1), view(*[node(f"n{i:02d}") for i in range(20)]))
    assert got.refusals == (Refusal("has no h100 GPUs (it has no GPUs)", tuple(f"n{i:02d}" for i in range(8)), 20),)


def test_multi_node_refusals_include_the_nodes_that_fit():
    got = place(gpu_req(8, nodes=2), view(node("a", "h100:8"), node("b", "h100:4")))
    assert {r.why: r.nodes for r in got.refusals} == {
        "4 of 4 h100 free, needs 8": ("b",), "fits, but the replica needs 2 such nodes": ("a",)}
