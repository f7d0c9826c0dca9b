"""Fair queueing through the gateway's views (fakeredis, in-process fake engines): whom a request is served
for (its key, and the sub-tenant a trusted front end names), what its key is charged and corrected by
the answer's usage, and what /metrics and /v1/llmgw/usage show of it (the console's: tests/unit/test_console_api.py)."""

from gateway.routing.fairness import DEFAULT_OUTPUT
from tests.support.clock import FakeClock
from tests.support.gateway_app import CHAT, endpoint, make_app, metric, server, store  # noqa: F401 - fixtures


def bearer(key: str, **headers) -> dict:
    return {"Authorization": f"Bearer {key}", **headers}


def test_a_key_is_charged_its_service_and_shown(store, upstreams):
    up = upstreams()  # each answer reports 5 prompt + 8 completion tokens
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=FakeClock(2_000_000_000.0, real_monotonic=True))
    kid, key = store.create_key("team-a", weight=2.0)
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "m", "max_tokens": 100}, headers=bearer(key)).status_code == 200
    # charged its estimate when sent, then what the answer said: 5 prompt + 2 x 8 output, over weight 2
    assert gw.ledger.counter("m", kid) == (5 + 2 * 8) / 2
    assert gw.ledger.expected_output("m", kid) == 8.0
    assert gw.fair_share.step() == 1
    page = c.get("/metrics").data.decode()
    assert metric(page, 'llmgw_gateway_tenant_service_tokens_total{key="team-a",model="m"}') == 21.0
    assert metric(page, 'llmgw_gateway_tenant_requests_total{key="team-a",model="m"}') == 1.0
    assert metric(page, 'llmgw_gateway_tenant_share{key="team-a",model="m"}') == 1.0
    mine = c.get("/v1/llmgw/usage", headers=bearer(key)).json
    assert (mine["weight"], mine["sub_tenants"], mine["shares"]) == (2.0, False, {"m": 1.0})
    assert DEFAULT_OUTPUT > 100  # (the estimate above was max_tokens, not the default)


def test_only_a_trusted_key_names_sub_tenants(store, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    _, plain = store.create_key("plain")
    _, front = store.create_key("front", sub_tenants=True)
    gw.keys.refresh()
    r = c.post(CHAT, json={"model": "m"}, headers=bearer(plain, **{"X-LLMGW-Tenant": "alice"}))
    assert r.status_code == 403
    assert r.json["error"]["code"] == "sub_tenants_not_allowed"
    assert "llmgw keys update plain --sub-tenants" in r.json["error"]["message"]
    bad = c.post(CHAT, json={"model": "m"}, headers=bearer(front, **{"X-LLMGW-Tenant": "al ice"}))
    assert bad.status_code == 400 and "X-LLMGW-Tenant" in bad.json["error"]["message"]
    ok = c.post(CHAT, json={"model": "m"}, headers=bearer(front, **{"X-LLMGW-Tenant": "alice"}))
    assert ok.status_code == 200
    kid = store.find_key("front").id
    assert gw.ledger.sub_counter("m", kid, "alice") == 5 + 2 * 8
    assert up.stats["requests"] == 1  # the refused ones never reached the engine
