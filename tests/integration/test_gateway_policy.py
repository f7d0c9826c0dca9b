"""Per-key policy through the gateway's views (fakeredis, in-process fake engines, a fake clock):
models a key may call, expiry, budgets counted from real answers, admin keys, the usage endpoint."""

import json
from datetime import datetime, timezone

import pytest

from gateway.app import create_app
from gateway.config import GatewaySettings
from llmgw.state import keys
from tests.support.clock import FakeClock
from tests.support.gateway_app import CHAT, endpoint, make_app, server, store  # noqa: F401 - fixtures

# 2026-03-14 23:59:00 UTC: a minute before the day's budget resets; rate-limit minutes stand still.
NOON = datetime(2026, 3, 14, 12, 0, tzinfo=timezone.utc).timestamp()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def clock():
    return FakeClock(NOON, real_monotonic=True)


def two_models(up):
    return [endpoint("e1", up.url), endpoint("e2", up.url, models=("other", "other-alias"))]


def test_a_key_sees_only_its_models(store, upstreams, clock):
    up = upstreams()
    _, gw, c = make_app(store, two_models(up), clock=clock)
    _, narrow = store.create_key("narrow", models=("m-alias",))  # an alias names its whole model
    _, wide = store.create_key("wide")
    gw.keys.refresh()
    for name in ("m", "m-alias"):
        assert c.post(CHAT, json={"model": name}, headers=bearer(narrow)).status_code == 200
    hidden = c.post(CHAT, json={"model": "other"}, headers=bearer(narrow))
    unknown = c.post(CHAT, json={"model": "nope"}, headers=bearer(narrow))
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.json == {"error": {"message": "model 'other' does not exist", "type": "invalid_request_error",
                                     "code": "model_not_found"}}
    assert unknown.json["error"]["message"] == "model 'nope' does not exist"
    listed = lambda k: sorted(m["id"] for m in c.get("/v1/models", headers=bearer(k)).json["data"])  # noqa: E731
    assert listed(narrow) == ["m", "m-alias"]
    assert listed(wide) == ["m", "m-alias", "other", "other-alias"]
    assert c.post(CHAT, json={"model": "other"}, headers=bearer(wide)).status_code == 200
    # `keys update` changes it without changing the key, once the gateway re-reads the table
    store.update_key("narrow", models=())
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "other"}, headers=bearer(narrow)).status_code == 200
    assert b'llmgw_gateway_denied_total{reason="model_not_found"} 2.0' in c.get("/metrics").data


def test_a_key_expires_on_the_clock(store, upstreams, clock):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock)
    _, key = store.create_key("temp", now=clock.time(), expires_at=clock.time() + 2)
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "m"}, headers=bearer(key)).status_code == 200
    clock.advance(1.9)
    assert c.get("/v1/models", headers=bearer(key)).status_code == 200
    clock.advance(0.1)  # two seconds after creation: expired
    r = c.post(CHAT, json={"model": "m"}, headers=bearer(key))
    assert r.status_code == 401
    assert r.json["error"] == {"message": "API key temp expired at 2026-03-14T12:00:02Z",
                               "type": "authentication_error", "code": "expired_api_key"}
    assert c.get("/v1/models", headers=bearer(key)).status_code == 401
    assert c.get("/v1/llmgw/usage", headers=bearer(key)).status_code == 401
    assert up.stats["requests"] == 1


def test_budget_the_request_that_crosses_it_is_the_last_served(store, upstreams, clock):
    up = upstreams()  # each answer reports 5 prompt + 8 completion tokens
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock)
    _, key = store.create_key("b", budget=30, budget_period="day")
    gw.keys.refresh()
    codes = [c.post(CHAT, json={"model": "m"}, headers=bearer(key)).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]  # 13, 26, 39: the third crossed 30 and was served in full
    r = c.post(CHAT, json={"model": "m"}, headers=bearer(key))
    assert r.json["error"]["code"] == "budget_exceeded" and r.json["error"]["type"] == "insufficient_quota"
    assert "spent 39 of its 30 tokens this day" in r.json["error"]["message"]
    assert int(r.headers["Retry-After"]) == 12 * 3600  # until 00:00 UTC
    assert up.stats["requests"] == 3

    # Another gateway on the same Redis learns the spent tokens from this one's flush.
    gw.usage.flush(gw.keys.budget_periods(clock.time()))
    assert int(store.r.get(keys.budget(gw.keys.find("b").id, "2026-03-14"))) == 39
    other = create_app(GatewaySettings(), store=store, clock=clock)
    gw2 = other.extensions["llmgw"]
    gw2.refresh()
    c2 = other.test_client()
    assert c2.post(CHAT, json={"model": "m"}, headers=bearer(key)).status_code == 200  # not read yet
    gw2.usage.flush(gw2.keys.budget_periods(clock.time()))  # its flush reads every gateway's total
    assert c2.post(CHAT, json={"model": "m"}, headers=bearer(key)).status_code == 429

    body = c.get("/v1/llmgw/usage", headers=bearer(key)).json
    assert body["budget"] == {"tokens": 30, "period": "day", "period_id": "2026-03-14", "used": 39,
                              "remaining": 0, "resets_at": "2026-03-15T00:00:00Z"}
    clock.advance(12 * 3600)  # a new UTC day, a new budget
    assert c.post(CHAT, json={"model": "m"}, headers=bearer(key)).status_code == 200
    store.update_key("b", budget=None)
    gw.keys.refresh()
    assert [c.post(CHAT, json={"model": "m"}, headers=bearer(key)).status_code for _ in range(3)] == [200] * 3


def test_a_budgeted_stream_asks_the_engine_for_its_usage(store, upstreams, clock):
    up = upstreams(tokens=4)
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock)
    _, key = store.create_key("s", budget=1000)
    gw.keys.refresh()
    r = c.post(CHAT, json={"model": "m", "stream": True, "messages": []}, headers=bearer(key))
    events = [line for line in r.data.split(b"\n") if line.startswith(b"data: {")]
    assert json.loads(events[-1][6:])["usage"]["completion_tokens"] == 4  # the client gets the chunk too
    kid = gw.keys.find("s").id
    assert gw.usage.spent(kid, "2026-03") == 9  # budgets are per month by default


def test_the_usage_endpoint_shows_a_key_its_own_usage(store, upstreams, clock):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock)
    _, admin = store.create_key("ops", admin=True)
    _, plain = store.create_key("team-a", rpm=100, models=("m",))
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "m"}, headers=bearer(plain)).status_code == 200
    gw.usage.flush()
    mine = c.get("/v1/llmgw/usage", headers=bearer(plain)).json
    assert mine["key"] == "team-a" and mine["admin"] is False and mine["budget"] is None
    assert mine["models"] == ["m"] and mine["rpm"] == 100 and mine["expires_at"] is None
    assert mine["usage"] == [{"model": "m", "prompt_tokens": 5, "completion_tokens": 8, "requests": 1}]
    assert c.get("/v1/llmgw/usage").status_code == 401
    # An ordinary key cannot read another key's usage (403); an admin key can.
    denied = c.get("/v1/llmgw/usage?key=ops", headers=bearer(plain))
    assert denied.status_code == 403 and denied.json["error"]["type"] == "permission_error"
    assert c.get("/v1/llmgw/usage?key=team-a", headers=bearer(admin)).json["key"] == "team-a"
    assert c.get("/v1/llmgw/usage?key=ghost", headers=bearer(admin)).status_code == 404


def test_require_admin_in_every_auth_mode(store, upstreams, clock):
    """`LLMGW_GATEWAY_AUTH=off` opens the OpenAI API, never what needs an admin key."""
    from flask import Flask, request

    from gateway.errors import ApiError

    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock, auth="off")
    _, admin = store.create_key("ops", admin=True)
    _, plain = store.create_key("team-a")
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "m"}).status_code == 200  # the OpenAI API is open

    def check(headers):
        with Flask("t").test_request_context("/admin", headers=headers):
            try:
                return gw.gate.require_admin(request.environ).name
            except ApiError as e:
                return e.status

    assert check({}) == 401 and check(bearer("sk-nope")) == 401
    assert check(bearer(plain)) == 403 and check(bearer(admin)) == "ops"
    store.update_key("ops", expires_at=clock.time() + 1)
    gw.keys.refresh()
    clock.advance(1)
    assert check(bearer(admin)) == 401  # an expired admin key is no key at all
