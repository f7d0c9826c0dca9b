"""The gateway's safety fixes on fakeredis and in-process fake engines: auth never fails open,
unknown model names cost no state, every in-flight slot is released, key priorities cap the header,
the clock and the randomness are the ones handed in."""

import time

import pytest

from gateway.config import RoutingConfig
from llmgw.state.records import LoadRecord
from tests.support.clock import FakeClock
from tests.support.gateway_app import (  # noqa: F401 - server, store: fixtures
    CHAT,
    NEVER_STALE,
    bare_app,
    endpoint,
    make_app,
    server,
    store,
    wall_clock,
)


# --- auth ------------------------------------------------------------------------------------------
def test_no_service_until_the_key_table_was_read(store, server, upstreams):
    up = upstreams()
    _, gw, c = bare_app(store, [endpoint("e1", up.url)])
    gw.pollers.refresh_endpoints()
    server.connected = False  # Redis goes away before the first key refresh
    gw.keys.refresh()
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 503 and r.json["error"]["code"] == "auth_unavailable"
    assert r.json["error"]["type"] == "server_error" and "API keys" in r.json["error"]["message"]
    assert c.get("/v1/models").status_code == 503
    server.connected = True
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "m"}).status_code == 200  # auto, and no key exists


def test_auth_off_serves_without_a_key_table(store, server, upstreams):
    up = upstreams()
    _, gw, c = bare_app(store, [endpoint("e1", up.url)], auth="off")
    store.create_key("k")
    gw.pollers.refresh_endpoints()
    server.connected = False
    assert c.post(CHAT, json={"model": "m"}).status_code == 200


def test_auth_required_with_no_keys_rejects_everyone(store, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], auth="required")
    assert c.post(CHAT, json={"model": "m"}).json["error"]["code"] == "invalid_api_key"
    _, key = store.create_key("k")
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "m"}, headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_redis_restarted_without_data_does_not_open_the_gateway(store, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    store.create_key("k")
    gw.keys.refresh()
    store.r.flushall()
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "m"}).status_code == 401


# --- unknown names ---------------------------------------------------------------------------------
def test_unknown_models_create_no_state_and_no_labels(store, upstreams):
    up = upstreams()
    # one wall-clock minute throughout, so a request spent on junk would surely count against the last one
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=wall_clock())
    _, key = store.create_key("k", rpm=1)
    gw.keys.refresh()
    auth = {"Authorization": f"Bearer {key}"}
    for i in range(50):
        r = c.post(CHAT, json={"model": f"junk-{i}"}, headers=auth)
        assert r.status_code == 404 and r.json["error"]["code"] == "model_not_found"
    assert set(gw.queues) <= {"m", "m-alias"}
    text = c.get("/metrics", headers=auth).get_data(as_text=True)
    assert "junk" not in text
    assert "llmgw_gateway_unknown_model_total 50.0" in text
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 200  # rpm not spent on junk


def test_503_before_the_endpoint_list_was_loaded(store, upstreams):
    up = upstreams()
    _, gw, c = bare_app(store, [endpoint("e1", up.url)], auth="off")
    r = c.post(CHAT, json={"model": "anything"})
    assert r.status_code == 503 and r.json["error"]["code"] == "no_ready_replica"
    assert not gw.queues


# --- slots are always released; SSE headers ---------------------------------------------------------
def test_unexpected_error_after_routing_releases_the_slot(store, upstreams, monkeypatch):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])

    def boom(*a, **kw):
        raise RuntimeError("bug")

    monkeypatch.setattr(gw.upstream, "send", boom)
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 500 and r.json["error"]["code"] == "internal_error"
    assert gw.router.inflight["e1"] == 0
    monkeypatch.undo()
    import gateway.http.answer as answer_mod

    monkeypatch.setattr(answer_mod, "response_headers", boom)  # after the upstream answered
    assert c.post(CHAT, json={"model": "m"}).status_code == 500
    assert gw.router.inflight["e1"] == 0


def test_stream_headers_disable_proxy_buffering(store, upstreams):
    up = upstreams(tokens=3)
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    r = c.post(CHAT, json={"model": "m", "stream": True})
    assert r.status_code == 200
    assert r.headers["X-Accel-Buffering"] == "no" and r.headers["Cache-Control"] == "no-cache"
    r.get_data()
    assert gw.router.inflight["e1"] == 0


# --- priority is capped by the key --------------------------------------------------------------
@pytest.mark.parametrize("key_prio", ["standard", None])
def test_key_priority_caps_the_header(store, upstreams, key_prio):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], queue_timeout=0.05, routing=NEVER_STALE)
    _, key = store.create_key("k", priority=key_prio)
    gw.keys.refresh()
    store.write_load(LoadRecord("e1", time.time(), True, running=4, waiting=9))  # saturated
    gw.pollers.refresh_loads()
    auth = {"Authorization": f"Bearer {key}", "X-LLMGW-Priority": "critical"}
    r = c.post(CHAT, json={"model": "m"}, headers=auth)
    assert r.status_code == 429 and r.json["error"]["code"] == "overloaded"  # not sent past saturation
    assert gw.gate.priority("sheddable", gw.keys.lookup(key)) == "sheddable"  # lowering is allowed


def test_critical_key_may_send_critical(store, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], queue_timeout=0.05, routing=NEVER_STALE)
    _, key = store.create_key("k", priority="critical")
    _, std = store.create_key("s", priority="standard")
    gw.keys.refresh()
    store.write_load(LoadRecord("e1", time.time(), True, running=4, waiting=9))
    gw.pollers.refresh_loads()
    # the endpoint is saturated (a standard key is turned away) ...
    assert c.post(CHAT, json={"model": "m"}, headers={"Authorization": f"Bearer {std}"}).status_code == 429
    # ... and the critical key's request is sent past it
    assert c.post(CHAT, json={"model": "m"}, headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_core_and_view_take_the_injected_clock_and_rng(store, upstreams):
    """A request is timed on the gateway's clock (standing still here: no time passes however long
    the engine takes), and routing draws from the seeded generator (near-ties picked at random
    come out the same for the same seed)."""
    up = upstreams(base=0.02)
    eps = [endpoint(f"e{i}", up.url) for i in range(4)]
    spread = RoutingConfig(tie_tolerance=10)  # every endpoint is a near-tie: each pick is a draw
    _, _, c = make_app(store, eps, clock=FakeClock(2_000_000_000.0, mono=500.0), routing=spread, seed=7)
    picks = [c.post(CHAT, json={"model": "m"}).headers["X-LLMGW-Endpoint"] for _ in range(12)]
    text = c.get("/metrics").get_data(as_text=True)
    assert 'llmgw_gateway_request_seconds_sum{model="m"} 0.0' in text
    assert 'llmgw_gateway_ttft_seconds_sum{model="m"} 0.0' in text
    _, _, again = make_app(store, eps, routing=spread, seed=7)
    assert [again.post(CHAT, json={"model": "m"}).headers["X-LLMGW-Endpoint"] for _ in range(12)] == picks
    assert len(set(picks)) > 1


def test_empty_priority_header_is_absent_and_healthz_shows_auth(store, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    assert c.post(CHAT, json={"model": "m"}, headers={"X-LLMGW-Priority": ""}).status_code == 200
    h = c.get("/healthz").json
    assert h["auth"] == "auto" and h["keys_loaded"] is True
