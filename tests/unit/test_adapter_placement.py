"""Adapter placement (workers/control/adapterplacement.py): table-driven cases and properties over random
fleets: never above max_loras, pinned everywhere, floors met when slots allow, spread over nodes,
busier adapters on more replicas, stable once applied, failed loads retried only after backoff."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.catalog import parse_catalog_text
from workers.control.adapterplacement import (
    AdapterWant,
    Backoff,
    LoadAdapter,
    LoadFailure,
    RelaunchWithAdapters,
    ReplicaSlots,
    UnloadAdapter,
    place_adapters,
    slots_for,
    wants_for,
)

ABC = frozenset("abc")


def rep(rid: str, node: str = "", max_loras: int = 2, serves=ABC, held=(), loading=(), **kw) -> ReplicaSlots:
    return ReplicaSlots(rid, node or f"n-{rid}", max_loras, frozenset(serves), frozenset(held), frozenset(loading), **kw)


def test_three_adapters_on_two_replicas_with_two_slots_each():
    plan = place_adapters([AdapterWant("a"), AdapterWant("b"), AdapterWant("c")], [rep("r1"), rep("r2")])
    assert all(len(plan.holders(x)) == 1 for x in "abc")
    assert all(len(s) <= 2 for s in plan.desired.values())
    assert sorted(a.adapter for a in plan.actions if isinstance(a, LoadAdapter)) == ["a", "b", "c"]
    assert plan.shortfalls == ()


def test_pinned_go_everywhere_first():
    wants = [AdapterWant("a", None), AdapterWant("b", 2), AdapterWant("c", 2)]
    plan = place_adapters(wants, [rep("r1"), rep("r2"), rep("r3")])
    assert plan.holders("a") == ("r1", "r2", "r3")
    assert len(plan.holders("b")) == 2 and len(plan.holders("c")) == 1
    assert [(s.adapter, s.wanted, s.placed) for s in plan.shortfalls] == [("c", 2, 1)]
    assert "every replica that serves it is full (6 adapter slots on 3 replicas" in plan.shortfalls[0].reason


def test_a_count_spreads_over_nodes_before_replicas():
    reps = [rep("r1", "n1"), rep("r2", "n1"), rep("r3", "n2")]
    plan = place_adapters([AdapterWant("a", 2)], reps)
    assert {r[1] for r in [("r1", "n1"), ("r2", "n1"), ("r3", "n2")] if r[0] in plan.holders("a")} == {"n1", "n2"}


def test_adapters_only_on_replicas_that_serve_them():
    plan = place_adapters([AdapterWant("a", 2), AdapterWant("z", 1)], [rep("r1", serves={"a"}), rep("r2", serves={"z"})])
    assert plan.holders("a") == ("r1",) and plan.holders("z") == ("r2",)
    assert [(s.adapter, s.wanted, s.placed) for s in plan.shortfalls] == []  # a's count is capped at what serves it


def test_nothing_serves_it():
    plan = place_adapters([AdapterWant("a")], [rep("r1", serves=set())])
    assert [(s.adapter, s.reason.split(" (")[0]) for s in plan.shortfalls] == [("a", "no replica serves it")]


def test_busier_adapters_get_more_replicas():
    reps = [rep(f"r{i}", max_loras=1) for i in range(6)]
    plan = place_adapters([AdapterWant(x) for x in "abc"], reps, demand={"a": 30.0, "b": 10.0, "c": 1.0})
    counts = {x: len(plan.holders(x)) for x in "abc"}
    assert counts["a"] > counts["b"] >= counts["c"] >= 1 and sum(counts.values()) == 6


def test_a_requested_adapter_with_no_floor_gets_a_replica_and_an_idle_one_none():
    plan = place_adapters([AdapterWant("a", 0), AdapterWant("b", 0)], [rep("r1")], demand={"a": 0.1})
    assert plan.holders("a") == ("r1",) and plan.holders("b") == ()


def test_nothing_changes_when_nothing_changed():
    wants = [AdapterWant("a"), AdapterWant("b"), AdapterWant("c")]
    # Held differently from what a fresh placement would choose: kept as it is.
    reps = [rep("r1", held={"a", "c"}), rep("r2", held={"b"})]
    plan = place_adapters(wants, reps)
    assert plan.actions == () and plan.desired == {"r1": {"a", "c"}, "r2": {"b"}}


def test_what_the_last_pass_assigned_outranks_what_is_only_still_held():
    """A busier adapter took a slot of a quieter one on r1; until r1's engine swaps them, it holds
    both the old set and the new. Placing again keeps the new one (a pass does not undo the last)."""
    wants = [AdapterWant("a"), AdapterWant("b"), AdapterWant("c")]
    demand = {"a": 0.01, "b": 0.01, "c": 1.0}
    reps = [rep("r1", held={"a", "b"}, assigned=frozenset({"b", "c"})),
            rep("r2", held={"a", "c"}, assigned=frozenset({"a", "c"})),
            rep("r3", ready=False, assigned=frozenset({"c"}))]
    plan = place_adapters(wants, reps, demand)
    assert plan.desired == {"r1": {"b", "c"}, "r2": {"a", "c"}, "r3": {"c"}}


def test_surplus_gives_way_only_to_a_need():
    wants = [AdapterWant("a"), AdapterWant("b")]
    reps = [rep("r1", max_loras=1, held={"a"}), rep("r2", max_loras=1, held={"a"})]
    plan = place_adapters(wants, reps)  # a has 2 (target 1); b needs 1: one of a's slots goes to b
    assert len(plan.holders("a")) == 1 and len(plan.holders("b")) == 1
    assert sorted(type(x).__name__ for x in plan.actions) == ["LoadAdapter", "UnloadAdapter"]
    # Without a need, the surplus stays.
    assert place_adapters([AdapterWant("a")], reps).actions == ()


def test_removed_adapters_are_unloaded_and_loading_ones_count_as_held():
    reps = [rep("r1", held={"a", "gone"}, loading={"b"})]
    plan = place_adapters([AdapterWant("a"), AdapterWant("b")], reps)
    assert plan.actions == (UnloadAdapter("r1", "gone"),)


def test_never_above_max_loras_even_if_it_holds_more():
    reps = [rep("r1", max_loras=1, held={"a", "b"})]
    plan = place_adapters([AdapterWant("a", None), AdapterWant("b")], reps)
    assert plan.desired["r1"] == {"a"} and plan.actions == (UnloadAdapter("r1", "b"),)


def test_a_failed_load_waits_for_its_backoff_then_is_retried():
    failure = LoadFailure("r1", "a", "vLLM found no adapter at '/x'", at=100.0, attempts=2)
    reps = [rep("r1", max_loras=1)]
    during = place_adapters([AdapterWant("a")], reps, failures=[failure], now=105.0, backoff=Backoff(base=5, cap=60))
    assert during.actions == () and during.holders("a") == ()
    (s,) = during.shortfalls
    assert "loading it failed on r1 (2x): vLLM found no adapter at '/x'; next try at 110" == s.reason
    after = place_adapters([AdapterWant("a")], reps, failures=[failure], now=110.0, backoff=Backoff(base=5, cap=60))
    assert after.actions == (LoadAdapter("r1", "a", attempt=3),)


def test_a_failed_replica_is_passed_over_for_another():
    failure = LoadFailure("r1", "a", "oom", at=100.0)
    plan = place_adapters([AdapterWant("a")], [rep("r1"), rep("r2")], failures=[failure], now=101.0)
    assert plan.holders("a") == ("r2",) and plan.shortfalls == ()


def test_backoff_doubles_up_to_its_cap():
    b = Backoff(base=5, cap=60)
    assert [b.retry_at(LoadFailure("r", "a", "", at=0.0, attempts=n)) for n in (1, 2, 3, 4, 5, 9)] == [
        5, 10, 20, 40, 60, 60]


def test_replicas_not_ready_get_a_desired_set_but_no_action():
    plan = place_adapters([AdapterWant("a")], [rep("r1", ready=False)])
    assert plan.desired == {"r1": {"a"}} and plan.actions == ()


def test_ready_replicas_are_preferred():
    plan = place_adapters([AdapterWant("a")], [rep("r1", ready=False), rep("r2")])
    assert plan.holders("a") == ("r2",)


def test_adapters_at_launch_are_a_relaunch():
    reps = [rep("r1", at_launch=True, held={"a"}), rep("r2", at_launch=True, held={"b"})]
    plan = place_adapters([AdapterWant("a"), AdapterWant("b"), AdapterWant("c")], reps)
    (action,) = plan.actions
    assert isinstance(action, RelaunchWithAdapters) and action.adapters in (("a", "c"), ("b", "c"))
    same = place_adapters([AdapterWant("a"), AdapterWant("b")], reps)
    assert same.actions == ()


def test_runtime_replicas_are_preferred_over_a_relaunch():
    plan = place_adapters([AdapterWant("a")], [rep("r1", at_launch=True), rep("r2")])
    assert plan.holders("a") == ("r2",)


def test_from_the_catalog():
    cat = parse_catalog_text("""
models:
  - name: m
    source: /m.gguf
    profiles:
      - {name: cpu, engine: llamacpp, replicas: 2, lora: {max_loras: 2}}
      - {name: cpu2, engine: llamacpp}
    adapters:
      - {name: a, source: /a.gguf, rank: 8, replicas: all}
      - {name: b, source: /b.gguf, rank: 8, replicas: 2}
""")
    m = cat.model("m")
    assert wants_for(m) == [AdapterWant("a", None), AdapterWant("b", 2)]
    assert slots_for(m, "cpu") == (2, frozenset({"a", "b"}), True)
    assert slots_for(m, "cpu2") == (0, frozenset(), False) and slots_for(m, "nope") == (0, frozenset(), False)


# --- properties --------------------------------------------------------------------------------

NAMES = [f"a{i}" for i in range(6)]


@st.composite
def fleets(draw):
    wants = [AdapterWant(n, draw(st.one_of(st.none(), st.integers(0, 4)))) for n in NAMES[:draw(st.integers(1, 6))]]
    reps = []
    for i in range(draw(st.integers(0, 6))):
        serves = frozenset(draw(st.lists(st.sampled_from(NAMES), max_size=6)))
        held = frozenset(draw(st.lists(st.sampled_from(NAMES), max_size=4)))
        reps.append(ReplicaSlots(f"r{i}", f"n{draw(st.integers(0, 2))}", draw(st.integers(1, 3)), serves, held,
                                 ready=draw(st.booleans())))
    demand = draw(st.dictionaries(st.sampled_from(NAMES), st.floats(0, 100), max_size=6))
    return wants, reps, demand


def applied(reps, plan):
    return [ReplicaSlots(r.replica_id, r.node, r.max_loras, r.serves, plan.desired[r.replica_id]) for r in reps]


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_properties(fleet):
    wants, reps, demand = fleet
    plan = place_adapters(wants, reps, demand)
    by_id = {r.replica_id: r for r in reps}
    wanted = {w.name for w in wants}
    for rid, held in plan.desired.items():
        r = by_id[rid]
        assert len(held) <= r.max_loras  # never more than max_loras
        assert held <= r.serves & wanted  # only what its profile serves and the catalog wants
    for w in wants:
        eligible = [r for r in reps if w.name in r.serves]
        got = len(plan.holders(w.name))
        floor = len(eligible) if w.replicas is None else min(w.replicas, len(eligible))
        short = [s for s in plan.shortfalls if s.adapter == w.name]
        assert got >= floor or short, (w, got, floor)  # a floor missed always says why
    for r in reps:  # pinned first: a replica with room for every pinned adapter it serves holds them all
        pins = {w.name for w in wants if w.replicas is None} & r.serves
        if len(pins) <= r.max_loras:
            assert pins <= plan.desired[r.replica_id]
    # Actions are exactly the difference between held and desired, and only for Ready replicas.
    for a in plan.actions:
        assert by_id[a.replica_id].ready
        if isinstance(a, LoadAdapter):
            assert a.adapter in plan.desired[a.replica_id] and a.adapter not in by_id[a.replica_id].held
        if isinstance(a, UnloadAdapter):
            assert a.adapter not in plan.desired[a.replica_id] and a.adapter in by_id[a.replica_id].held
    # Stable: once applied, the same inputs ask for nothing more and keep the same sets.
    again = place_adapters(wants, applied(reps, plan), demand)
    assert again.actions == () and again.desired == plan.desired


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(0, 5))
def test_spread_over_nodes(fleet, extra):
    """A counted adapter placed on several replicas uses as many distinct nodes as it can."""
    wants, reps, _ = fleet
    reps = [ReplicaSlots(r.replica_id, r.node, r.max_loras + extra, r.serves) for r in reps]  # empty, roomy
    plan = place_adapters(wants, reps)
    node = {r.replica_id: r.node for r in reps}
    for w in wants:
        holders = plan.holders(w.name)
        nodes_available = {r.node for r in reps if w.name in r.serves}
        pins = sum(1 for x in wants if x.replicas is None)
        if w.replicas and all(r.max_loras >= len(wants) for r in reps) and pins == 0:
            assert len({node[h] for h in holders}) == min(len(holders), len(nodes_available))
