"""LoRA adapters on the request path, pure parts: the adapter table built with the routing tables
(gateway/routing/adapters.py from the catalog outline and the endpoints' held lists), the router
choosing only among holders, the body each engine receives (gateway/request/call.py), and what a
request costs to route (timeit, printed)."""

from __future__ import annotations

import json
import random
import timeit

import fakeredis

from gateway.config import RoutingConfig
from gateway.request.call import Call, engine_request
from gateway.request.surface import ROUTES
from gateway.routing.adapters import NO_ADAPTER, AdapterRoute, no_holder
from gateway.routing.admission import load_hold
from gateway.routing.choice import Choice, RouteRequest
from gateway.routing.admission import Hold
from gateway.routing.router import Router
from gateway.routing.tables import Snapshot, tables_from
from llmgw import surface as op
from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.state.clock import Clock
from llmgw.state.records import EndpointInfo
from llmgw.state.store import Store

CATALOG = parse_catalog({"models": [
    {"name": "m", "source": "/m.gguf", "profiles": [
        {"name": "gpu", "engine": "sim", "replicas": 2, "lora": {"max_loras": 2}},
        {"name": "cpu", "engine": "llamacpp", "replicas": 1, "start_timeout": 90, "lora": {"max_loras": 2}}],
     "adapters": [{"name": "a1", "aliases": ["x1"], "source": "/ad/a1.gguf", "rank": 8, "profiles": ["cpu"],
                   "scale": 0.5},
                  {"name": "a2", "source": "/ad/a2", "rank": 8, "profiles": ["gpu"], "replicas": 0}]},
]})


def outline():
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    apply_catalog(store, CATALOG, source="t", applied_by="t", now=0)
    return store.catalog_outline()


def ep(i, engine="sim", profile="gpu", adapters=()):
    return EndpointInfo(id=i, url=f"http://{i}", models=("m",), engine=engine, served_name="m", model="m",
                        profile=profile, capacity=4, adapters=tuple(adapters), adapter_slots=2)


def test_the_outline_carries_each_adapters_names_profiles_and_wait():
    o = outline()
    assert o.adapters["a1"] == {"model": "m", "names": ["a1", "x1"], "scale": 0.5, "replicas": 1, "profiles": ["cpu"],
                                "wait": 90.0}
    assert o.adapters["a2"]["wait"] == 60.0 and o.adapters["a2"]["replicas"] == 0
    assert o.canonical["x1"] == "a1" and ("a1", "x1") in o.groups


def test_the_table_knows_each_adapters_holders_and_who_could_load_it():
    eps = [ep("g1", adapters=["a2"]), ep("g2"), ep("c1", "llamacpp", "cpu", ["a1"])]
    t = tables_from(1, "fp", eps, outline(), {})
    a1, a2 = t.adapters["x1"], t.adapters["a2"]
    assert a1 is t.adapters["a1"] and [e.id for e in a1.holders] == ["c1"] and a1.servers == 1
    assert [e.id for e in a2.holders] == ["g1"] and a2.servers == 2 and a2.on_demand
    assert {"a1", "x1", "a2"} <= t.known_models and t.names_of("x1") == frozenset({"a1", "x1"})
    assert t.canonical["x1"] == "a1"


def test_a_request_for_an_adapter_is_routed_only_to_its_holders():
    eps = [ep("g1", adapters=["a2"]), ep("g2"), ep("g3", adapters=["a2"])]
    r = Router(RoutingConfig(), Clock(), random.Random(1))
    r.apply_tables(tables_from(1, "fp", eps, outline(), {}), True)
    picks = [r.route(RouteRequest("a2")) for _ in range(6)]
    assert {c.endpoint.id for c in picks} == {"g1", "g3"} and all(c.adapter == "a2" for c in picks)
    assert r.counts.by_model["a2"] == 6 and r.counts.by_model["m"] == 6  # counted for both
    for c in picks:
        r.release(c, None)
    assert r.counts.by_model["a2"] == 0
    none = Router(RoutingConfig(), Clock(), random.Random(1))
    none.apply_tables(tables_from(1, "fp", [ep("g2")], outline(), {}), True)
    res = none.route(RouteRequest("a2"))
    assert (res.kind, res.model, res.detail) == (NO_ADAPTER, "a2", "no replica holds adapter 'a2' loaded yet")


def test_waiting_for_a_load_only_when_one_can_come():
    route = AdapterRoute("a", "m", ("a",), servers=1, wait=30)
    assert load_hold(route, 0, 4) == Hold(30)
    assert load_hold(AdapterRoute("a", "m", ("a",)), 0, 4) is None
    assert load_hold(AdapterRoute("a", "m", ("a",), can_cold_start=True, wait=120), 0, 4) == Hold(120)
    assert "none can load it" in no_holder(AdapterRoute("a", "m", ("a",)))


def body_for(model: str, e: EndpointInfo, adapter: AdapterRoute | None, **extra) -> dict:
    raw = json.dumps({"model": model, "messages": [], **extra}).encode()
    call = Call(ROUTES[op.CHAT], model, raw, json.loads(raw))
    return json.loads(engine_request(call, adapter, e).body)


def test_each_engine_receives_the_adapter_as_it_serves_it():
    t = tables_from(1, "fp", [], outline(), {})
    a1, a2 = t.adapters["a1"], t.adapters["a2"]
    vllm = ep("g1", adapters=["a2"])
    assert body_for("a2", vllm, a2)["model"] == "a2"
    assert body_for("m", vllm, None)["model"] == "m"
    llama = EndpointInfo(id="c1", url="http://c1", models=("m",), engine="llamacpp", served_name="m", model="m",
                         adapters=("z", "a1"))
    sent = body_for("x1", llama, a1, lora=[{"id": 0, "scale": 9}])
    assert sent["model"] == "m" and sent["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
    # The base model on a llama.cpp replica holding adapters: every one at 0 (else the launch scales apply).
    assert body_for("m", llama, None)["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    plain = EndpointInfo(id="c2", url="http://c2", models=("m",), engine="llamacpp", served_name="m", model="m")
    assert "lora" not in body_for("m", plain, None)


def test_routing_an_adapter_costs_microseconds():
    eps = [ep(f"g{i}", adapters=["a2"] if i % 2 else []) for i in range(8)]
    r = Router(RoutingConfig(), Clock(), random.Random(1))
    r.apply_tables(tables_from(1, "fp", eps, outline(), {}), True)
    r.snapshot = Snapshot(r.tables, {}, {})

    def once(model):
        c = r.route(RouteRequest(model))
        r.release(c, None)

    n = 2000
    base = min(timeit.repeat(lambda: once("m"), number=n, repeat=3)) / n * 1e6
    adapter = min(timeit.repeat(lambda: once("a2"), number=n, repeat=3)) / n * 1e6
    # What the adapter path adds to a model's: the table lookup, the request for its model, the Choice.
    ad, req, c = r.tables.adapters["a2"], RouteRequest("a2"), r.route(RouteRequest("m"))

    def extra():
        if r.tables.adapters and req.model in r.tables.adapters:
            RouteRequest(ad.model, req.priority, req.affinity, req.exclude, req.queued, op=req.op, pin=req.pin,
                         waited=req.waited)
            Choice(c.endpoint, c.score, c.ahead, c.saturated, c.reason, ad.name)

    added = min(timeit.repeat(extra, number=n, repeat=3)) / n * 1e6
    print(f"route + release: base model {base:.1f} us, adapter {adapter:.1f} us (8 endpoints, 4 holding it); "
          f"the adapter path adds {added:.2f} us")
    assert adapter < 10 * base + 50  # same order as a model's; a generous bound for a loaded machine


def test_an_endpoint_a_request_failed_on_counts_again_once_it_left_the_list_and_came_back():
    from gateway.routing.adapters import Lift, lifted

    assert lifted(frozenset({"e1"}), {"e1", "e2"}, frozenset()) == (frozenset({"e1"}), frozenset())
    assert lifted(frozenset({"e1"}), {"e2"}, frozenset()) == (frozenset(), frozenset({"e1"}))
    lift = Lift(frozenset({"e1", "e3"}))
    assert lift({"e1", "e2", "e3"}) == {"e1", "e3"}  # still listed: still excluded
    assert lift({"e2", "e3"}) == {"e3"}  # e1 left (its engine stopped)...
    assert lift({"e1", "e2", "e3"}) == {"e3"}  # ... and is back: another engine, tried again
    # An engine that restarted at another address between two looks is another engine too.
    at = {i: EndpointInfo(id=i, url=f"http://127.0.0.1:{n}", models=("m",), engine="sim") for i, n in (("e1", 1), ("e2", 2))}
    lift = Lift(frozenset({"e1", "e2"}), at)
    assert lift(at) == {"e1", "e2"}
    assert lift({**at, "e1": EndpointInfo(id="e1", url="http://127.0.0.1:9", models=("m",), engine="sim")}) == {"e2"}
    # The list of the moment the wait begins may already show the engine back at its new address:
    # the address it failed at (`failed_at`) is what tells it is another engine.
    back = {**at, "e1": EndpointInfo(id="e1", url="http://127.0.0.1:9", models=("m",), engine="sim")}
    assert Lift(frozenset({"e1"}), back)(back) == {"e1"}  # without it: excluded for good
    assert Lift(frozenset({"e1"}), back, {"e1": "http://127.0.0.1:1"})(back) == frozenset()
