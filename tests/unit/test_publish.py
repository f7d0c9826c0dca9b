"""Publishing: which replicas become endpoints, the fingerprint, the pass's decision over one view,
and the publish pass on fakeredis."""

from __future__ import annotations

import dataclasses

import fakeredis
import pytest

from llmgw.catalog import apply_catalog
from llmgw.state.records import EndpointInfo
from llmgw.state.store import Store
from llmgw.state.views import PublishView
from tests.unit.control_support import Sim, catalog, cpu_profile, gpu_profile, model, node, ready_record
from workers.control.publish_pass import publish_once
from workers.control.publish import decide, endpoints_from, fingerprint

NOW = 1000.0


def cat():
    return catalog(
        model("llama", gpu_profile(replicas=2, priority=3, weight=2.0, capacity=32, pool="gpu"), aliases=["l3"]),
        model("tiny", cpu_profile()),
    )


def test_ready_replicas_become_endpoints_sorted_by_id():
    live = {"a": node("a", "h100:2", pool="gpu"), "b": node("b")}
    recs = [
        ready_record("z-tiny", "tiny", "cpu", "b", NOW),
        ready_record("a-llama", "llama", "gpu", "a", NOW, gpus={"a": [0]}),
    ]
    eps = endpoints_from(cat(), recs, live, NOW)
    assert [e.id for e in eps] == ["a-llama", "z-tiny"]
    e = eps[0]
    assert e.url == "http://a:1"  # trailing slash trimmed
    assert e.models == ("llama", "l3") and e.served_name == "llama" and e.model == "llama"
    assert (e.engine, e.pool, e.weight, e.priority, e.capacity) == ("vllm", "gpu", 2.0, 3, 32)
    assert (e.profile, e.node) == ("gpu", "a")


@pytest.mark.parametrize(
    "change,why",
    [
        ({"first_ready_at": None}, "starting"),
        ({"last_probe_ok": False}, "unhealthy"),
        ({"stop_requested_at": NOW - 1}, "stopping"),
        ({"exited_at": NOW - 1, "failure_times": [NOW - 1]}, "failed"),
        ({"url": None}, "no url"),
        ({"node": "gone", "nodes": ["gone"], "first_ready_at": None}, "lost while starting"),
    ],
)
def test_replicas_that_are_not_ready_are_not_published(change, why):
    rec = dataclasses.replace(ready_record("r", "tiny", "cpu", "b", NOW), **change)
    assert endpoints_from(cat(), [rec], {"b": node("b")}, NOW) == [], why


def test_a_model_that_left_the_catalog_is_never_published_even_while_stopping():
    sim = Sim(catalog(model("old", cpu_profile()), model("tiny", cpu_profile())), {"b": node("b")})
    sim.converge(2)
    assert {e.model for e in endpoints_from(sim.cat, sim.records.values(), sim.nodes, sim.now)} == {"old", "tiny"}
    sim.cat = catalog(model("tiny", cpu_profile()))
    # Before the reconciler even ran, and while the engine is still stopping: not routable.
    assert {e.model for e in endpoints_from(sim.cat, sim.records.values(), sim.nodes, sim.now)} == {"tiny"}
    sim.reconcile()
    old = next(r for r in sim.records.values() if r.model == "old")
    assert old.stop_requested_at is not None and old.stopped_at is None
    assert {e.model for e in endpoints_from(sim.cat, sim.records.values(), sim.nodes, sim.now)} == {"tiny"}


def test_fingerprint_is_order_independent_and_sees_routing_fields():
    recs = [ready_record("x", "tiny", "cpu", "b", NOW), ready_record("y", "tiny", "cpu", "b", NOW)]
    eps = endpoints_from(cat(), recs, {"b": node("b")}, NOW)
    assert fingerprint(eps) == fingerprint(list(reversed(eps)))
    heavier = [dataclasses.replace(eps[0], weight=5.0), eps[1]]
    assert fingerprint(heavier) != fingerprint(eps)
    assert fingerprint([]) != fingerprint(eps)


def test_publish_pass_writes_only_when_the_list_changes():
    r = fakeredis.FakeRedis(decode_responses=True)
    store = Store(r)
    apply_catalog(store, cat(), source="test", applied_by="test", now=NOW)
    store.write_heartbeat(node("b"), ttl=60)
    rec = ready_record("x", "tiny", "cpu", "b", NOW)
    store.create_replica(rec)
    assert publish_once(store, lambda: NOW) == 1
    assert publish_once(store, lambda: NOW + 1) is None  # unchanged: no new version
    version, _fp, eps = store.read_endpoints()
    assert version == 1 and [e.id for e in eps] == ["x"]
    store.update_replica("x", last_probe_ok=False)
    assert publish_once(store, lambda: NOW + 2) == 2
    assert store.read_endpoints().endpoints == []


def test_publish_pass_skips_while_another_holds_the_lock():
    from llmgw.state import keys

    r = fakeredis.FakeRedis(decode_responses=True)
    store = Store(r)
    apply_catalog(store, cat(), source="test", applied_by="test", now=NOW)
    with store.lock(keys.PUBLISH_LOCK, 10) as held:
        assert held
        assert publish_once(store, lambda: NOW) is None
    assert store.endpoints_version() == 0


def test_a_lost_nodes_ready_replica_stays_routable_until_the_gateways_fail_to_reach_it_or_the_grace_ends():
    """The engines are the data plane: an agent's death alone does not unpublish them (#17)."""
    from llmgw.state.demand_records import EndpointUse, GatewayReport
    from workers.control.publish import merge_evidence

    rec = dataclasses.replace(ready_record("r", "tiny", "cpu", "gone", NOW))
    live = {"b": node("b")}
    assert [e.id for e in endpoints_from(cat(), [rec], live, NOW, last_seen={"gone": NOW - 20})] == ["r"]
    failing = merge_evidence([GatewayReport(id="g", at=NOW, endpoints={"r": EndpointUse(fail_at=NOW - 1)})])
    assert endpoints_from(cat(), [rec], live, NOW, last_seen={"gone": NOW - 20}, evidence=failing) == []
    assert endpoints_from(cat(), [rec], live, NOW, last_seen={"gone": NOW - 301}) == []


def test_the_publish_pass_stamps_the_version_from_which_a_stopping_replica_is_unrouted():
    r = fakeredis.FakeRedis(decode_responses=True)
    store = Store(r)
    apply_catalog(store, cat(), source="test", applied_by="test", now=NOW)
    store.write_heartbeat(node("b"), ttl=60)
    for rid in ("x", "y"):
        store.create_replica(ready_record(rid, "tiny", "cpu", "b", NOW))
    assert publish_once(store, lambda: NOW) == 1
    store.update_replica("x", stop_requested_at=NOW + 1, drain_timeout=120.0)
    assert publish_once(store, lambda: NOW + 2) == 2  # x left the list ...
    assert store.get_replica("x").unpublished_version == 2  # ... as of version 2
    assert store.get_replica("y").unpublished_version is None
    # A replica asked to stop that was never in the list is stamped with the version in force.
    store.create_replica(dataclasses.replace(ready_record("z", "tiny", "cpu", "b", NOW), first_ready_at=None,
                                             stop_requested_at=NOW + 3))
    assert publish_once(store, lambda: NOW + 3) is None
    assert store.get_replica("z").unpublished_version == 2


def test_the_publish_pass_weighs_the_gateways_evidence_for_a_lost_nodes_replica():
    from llmgw.state.demand_records import EndpointUse, GatewayReport

    r = fakeredis.FakeRedis(decode_responses=True)
    store = Store(r)
    apply_catalog(store, cat(), source="test", applied_by="test", now=NOW)
    store.write_heartbeat(dataclasses.replace(node("b"), heartbeat_at=NOW - 10), ttl=60)
    store.create_replica(ready_record("x", "tiny", "cpu", "b", NOW))
    assert publish_once(store, lambda: NOW) == 1
    r.delete("llmgw:node:b:heartbeat")  # the agent died; its engine may still serve
    assert publish_once(store, lambda: NOW + 5) is None  # still routable
    store.write_gateway_report(GatewayReport(id="g1", at=NOW + 6, endpoints={"x": EndpointUse(fail_at=NOW + 6)}), 10)
    assert publish_once(store, lambda: NOW + 7) == 2
    assert store.read_endpoints().endpoints == []


# --- the publish pass's decision over one view (pure) -------------------------------------------------
def view(*recs, live=("b",), fingerprint="", version=1):
    return PublishView(replicas=tuple(recs), live={n: node(n) for n in live}, version=version,
                       fingerprint=fingerprint)


READY_X = ready_record("x", "tiny", "cpu", "b", NOW)
STOPPING_Y = dataclasses.replace(ready_record("y", "tiny", "cpu", "b", NOW), stop_requested_at=NOW - 1)
EXTERNAL = EndpointInfo(id="ext-a", url="http://ext", models=("tiny",), engine="external", model="tiny")


def fp_of(*recs, catalog_version=1, live=("b",)):
    """The fingerprint a pass over these records publishes (as if it had been published)."""
    return decide(cat(), catalog_version, view(*recs, live=live), NOW).fingerprint


@pytest.mark.parametrize("case, v, catalog_version, externals, last_live, expect", [
    ("the first list is written", view(READY_X), 1, (), None,
     dict(changed=True, ids=["x"], unpublish=(), lost=(), returned=())),
    ("an unchanged list writes nothing", view(READY_X, fingerprint=fp_of(READY_X)), 1, (), None,
     dict(changed=False, ids=["x"], unpublish=())),
    ("a new catalog version alone writes the list (gateways re-read the names)",
     view(READY_X, fingerprint=fp_of(READY_X)), 2, (), None, dict(changed=True, ids=["x"])),
    ("a replica asked to stop leaves the list and is stamped", view(READY_X, STOPPING_Y), 1, (), None,
     dict(changed=True, ids=["x"], unpublish=("y",))),
    ("a stopping replica is stamped even when the list is unchanged",
     view(READY_X, STOPPING_Y, fingerprint=fp_of(READY_X)), 1, (), None, dict(changed=False, unpublish=("y",))),
    ("a stopping replica already stamped is not stamped again",
     view(READY_X, dataclasses.replace(STOPPING_Y, unpublished_version=3)), 1, (), None, dict(unpublish=())),
    ("an unlisted replica not asked to stop is not stamped",
     view(dataclasses.replace(READY_X, last_probe_ok=False)), 1, (), None, dict(ids=[], unpublish=())),
    ("external servers join the list, by id", view(READY_X), 1, (EXTERNAL,), None, dict(ids=["ext-a", "x"])),
    ("a process's first pass compares no nodes", view(READY_X, live=("a", "b")), 1, (), None,
     dict(lost=(), returned=(), nodes_changed=False)),
    ("a node that went quiet is lost", view(READY_X, live=("b",)), 1, (), frozenset({"a", "b"}),
     dict(lost=("a",), returned=(), nodes_changed=True)),
    ("a node that joined is back", view(READY_X, live=("b", "c")), 1, (), frozenset({"b"}),
     dict(lost=(), returned=("c",), nodes_changed=True)),
    ("the same live nodes change nothing", view(READY_X), 1, (), frozenset({"b"}),
     dict(nodes_changed=False)),
])
def test_the_publish_decision(case, v, catalog_version, externals, last_live, expect):
    d = decide(cat(), catalog_version, v, NOW, externals, last_live)
    got = {"changed": d.changed, "ids": [e.id for e in d.endpoints], "unpublish": d.unpublish, "lost": d.lost,
           "returned": d.returned, "nodes_changed": d.nodes_changed}
    assert {k: got[k] for k in expect} == expect, case
    assert d.live == frozenset(v.live)


def test_the_publish_view_is_read_and_written_in_one_call_each():
    """What publish_once reads (`Store.publish_view`) and writes (`Store.write_publish`), and no more."""
    r = fakeredis.FakeRedis(decode_responses=True)
    store = Store(r)
    apply_catalog(store, cat(), source="test", applied_by="test", now=NOW)
    store.write_heartbeat(node("b"), ttl=60)
    for rec in (READY_X, STOPPING_Y):
        store.create_replica(rec)
    v = store.publish_view()
    assert {r.id for r in v.replicas} == {"x", "y"} and set(v.live) == {"b"} and (v.version, v.fingerprint) == (0, "")
    assert v.catalog == store.catalog_document()
    d = decide(cat(), 1, v, NOW)
    assert store.write_publish(d.endpoints, d.fingerprint, d.unpublish, v.version, NOW) == 1
    assert store.get_replica("y").unpublished_version == 1 and store.get_replica("x").unpublished_version is None
    assert [e.message for e in store.latest_events() if e.kind == "endpoints_published"] == ["1 endpoint"]
    again = store.publish_view()
    assert (again.version, again.fingerprint) == (1, d.fingerprint)
    # Unchanged: nothing but the stamps of what is newly stopping, at the version in force.
    assert store.write_publish(None, d.fingerprint, ["x"], again.version, NOW) == 1
    assert store.get_replica("x").unpublished_version == 1 and store.endpoints_version() == 1


def test_an_empty_list_says_it_is_no_failure():
    """Before any replica is Ready (a fleet starting) the list published is empty: its event says why."""
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    store.write_publish([], "fp", [], 0, NOW)
    (e,) = [e for e in store.latest_events() if e.kind == "endpoints_published"]
    assert e.message == "0 endpoints: no replica is Ready to route to (the gateways learn the catalog's names from it)"
    assert e.data["count"] == 0


def test_the_catalogs_routing_objective_is_published_on_every_endpoint_of_its_model():
    c = catalog({**model("tiny", cpu_profile()), "routing": {"objective": "completion"}}, model("other", cpu_profile()))
    recs = [ready_record("t1", "tiny", "cpu", "b", NOW), ready_record("o1", "other", "cpu", "b", NOW)]
    eps = {e.id: e for e in endpoints_from(c, recs, {"b": node("b")}, NOW)}
    assert eps["t1"].objective == "completion" and eps["o1"].objective == ""
    assert EndpointInfo.from_dict(eps["t1"].to_dict()) == eps["t1"]


def test_a_replica_whose_spec_left_the_catalog_is_published_as_retiring():
    """A rolling update replaces it and drains it once its replacement is Ready; until then it serves,
    and a continuation goes elsewhere while it can (gateway.routing.choice.eligible)."""
    from llmgw.catalog import profile_spec_hash
    from workers.control.plan import legacy_spec_hash

    c = cat()
    tiny = next(m for m in c.models if m.name == "tiny")
    prof = tiny.profile("cpu")
    recs = [ready_record("cur", "tiny", "cpu", "b", NOW, spec_hash=profile_spec_hash(tiny, prof)),
            ready_record("legacy", "tiny", "cpu", "b", NOW, spec_hash=legacy_spec_hash(tiny, prof)),
            ready_record("old", "tiny", "cpu", "b", NOW, spec_hash="0123456789ab")]
    eps = {e.id: e.retiring for e in endpoints_from(c, recs, {"b": node("b")}, NOW)}
    assert eps == {"cur": False, "legacy": False, "old": True}
    # the endpoint list changes with it: the gateways learn it at the next publish
    flipped = [dataclasses.replace(e, retiring=not e.retiring) for e in endpoints_from(c, recs, {"b": node("b")}, NOW)]
    assert fingerprint(flipped) != fingerprint(endpoints_from(c, recs, {"b": node("b")}, NOW))
