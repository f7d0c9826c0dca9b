"""What a gateway process reports (GatewayReport), when it is ready (/readyz), and its cap on open
requests: on fakeredis and in-process fake engines."""

from __future__ import annotations

import threading
import time

from llmgw.state.demand_records import EndpointUse, ModelDemand
from tests.support.gateway_app import (  # noqa: F401 - server, store: fixtures
    CHAT,
    bare_app,
    dead_url,
    endpoint,
    make_app,
    server,
    store,
    wall_clock,
)


def test_state_counts_per_endpoint_and_model_and_the_report_reaches_redis(store, upstreams):
    up = upstreams(gate=True, max_seqs=4)
    clock = wall_clock()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock)
    t = threading.Thread(target=c.post, args=(CHAT,), kwargs={"json": {"model": "m-alias"}})
    t.start()
    try:
        deadline = time.monotonic() + 10
        while gw.router.inflight.get("e1") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        rep = gw.background.report()
        # in flight, counted under the canonical name although the alias was asked for
        assert rep.endpoints["e1"].inflight == 1 and rep.models["m"] == ModelDemand(1, 0, clock.t)
        assert rep.version == gw.router.tables.version == store.endpoints_version() and rep.keys_loaded
    finally:
        up.open_gate()
        t.join(10)
    rep = gw.background.report()
    assert rep.endpoints["e1"] == EndpointUse(0, clock.t, None)  # a response head arrived
    assert rep.models["m"].inflight == 0
    gw.store.write_gateway_report(rep, 3)
    assert [r.id for r in store.gateway_reports()] == [gw.identity.id]


def test_a_refused_connection_is_evidence_against_the_endpoint(store, upstreams):
    up = upstreams()
    clock = wall_clock()
    _, gw, c = make_app(store, [endpoint("dead", dead_url()), endpoint("good", up.url)], clock=clock)
    # Each request is answered (a refused connection is retried on "good"); the router picks "dead"
    # for some of them, not for a given one: ask until it has.
    for _ in range(100):
        assert c.post(CHAT, json={"model": "m"}).status_code == 200
        if "dead" in gw.background.report().endpoints:
            break
    else:
        raise AssertionError("100 requests and none was routed to the dead endpoint")
    rep = gw.background.report()
    assert rep.endpoints["dead"] == EndpointUse(0, None, clock.t)
    assert rep.endpoints["good"].ok_at == clock.t


def test_loading_a_new_list_reports_at_once(store, upstreams):
    up = upstreams()
    _, gw, _ = make_app(store, [endpoint("e1", up.url)])
    gw.background.report_due.clear()
    store.write_endpoints([endpoint("e2", up.url)], "fp2", time.time())
    assert gw.pollers.refresh_endpoints()
    assert gw.background.report_due.is_set()  # the report loop writes now, not at its next tick


def test_readyz_waits_for_the_list_and_the_keys(store, server, upstreams):
    up = upstreams()
    app, gw, c = bare_app(store, [endpoint("e1", up.url)])
    r = c.get("/readyz")
    assert r.status_code == 503 and "API keys" in r.json["reason"]
    assert "gunicorn_conf" in r.json["reason"]  # never started: says how it should be served
    gw.keys.refresh()
    r = c.get("/readyz")
    assert r.status_code == 503 and "endpoint list" in r.json["reason"]
    server.connected = False
    gw.pollers.refresh_endpoints()
    r = c.get("/readyz")
    assert r.status_code == 503 and "Redis unavailable" in r.json["reason"]
    server.connected = True
    gw.pollers.refresh_endpoints()
    r = c.get("/readyz")
    assert r.status_code == 200 and r.json == {"ready": True, "endpoints_version": 1}
    assert c.get("/healthz").json["ready"] is True


def test_serve_waits_until_ready_or_gives_up(store, server, upstreams):
    up = upstreams()
    _, gw, _ = bare_app(store, [endpoint("e1", up.url)])
    ticks = []
    try:
        assert gw.serve(10, tick=lambda: ticks.append(1)) is True
        assert gw.not_ready() is None
    finally:
        gw.stop()
    _, gw2, c = bare_app(store, [endpoint("e1", up.url)])
    server.connected = False  # Redis down at start: bounded wait, then serve 503s that say why
    try:
        t0 = time.monotonic()
        assert gw2.serve(0.3, tick=lambda: ticks.append(1)) is False
        assert time.monotonic() - t0 >= 0.3 and ticks
        r = c.post(CHAT, json={"model": "m"})
        assert r.status_code == 503 and "Redis unavailable" in r.json["error"]["message"]
    finally:
        gw2.stop()


def test_requests_beyond_the_cap_get_503_with_retry_after(store, upstreams):
    up = upstreams(gate=True)
    _, gw, c = make_app(store, [endpoint("e1", up.url, capacity=10)])
    gw.max_open = 1
    t = threading.Thread(target=c.post, args=(CHAT,), kwargs={"json": {"model": "m"}})
    t.start()
    try:
        deadline = time.monotonic() + 10
        while gw.open != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = c.post(CHAT, json={"model": "m"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json["error"]["code"] == "gateway_overloaded" and "MAX_CONNECTIONS" in r.json["error"]["message"]
        assert c.get("/healthz").status_code == 200  # probes still answer
    finally:
        up.open_gate()
        t.join(10)
    assert gw.open == 0
    # a stream holds its place until it ends, then gives it back
    r = c.post(CHAT, json={"model": "m", "stream": True})
    assert gw.open == 1
    r.get_data()
    r.close()
    assert gw.open == 0
