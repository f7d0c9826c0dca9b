"""Latency targets through the gateway (tests/support/gateway_app.py, in-process fake engines): a bad
header is a 400 that names it; a strict request no endpoint is predicted to meet is refused at once
with the predicted time and Retry-After; a request that met its targets counts as met per model, key
and endpoint, its prediction beside what happened (per engine), and `llmgw explain` says both."""

from __future__ import annotations

import time
from dataclasses import replace

from gateway.routing.load import EndpointStats
from gateway.routing.speed import Speed
from tests.support.gateway_app import CHAT, endpoint, make_app, metric, server, store  # noqa: F401 - fixtures

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}}


def learned(gw, **speeds):
    """The router as if it had learned these speeds (the background loops do not run here)."""
    now = gw.router.clock.monotonic()
    snap = gw.router.snapshot
    gw.router.snapshot = replace(snap, stats={i: EndpointStats(speed=sp, last_sample=now) for i, sp in speeds.items()})


def test_a_bad_target_header_is_a_400_naming_it(store, upstreams):  # noqa: F811
    up = upstreams()
    _, _, c = make_app(store, [endpoint("e1", up.url)])
    r = c.post(CHAT, json=BODY, headers={"X-LLMGW-TTFT": "300"})
    err = r.get_json()["error"]
    assert r.status_code == 400 and err["param"] == "X-LLMGW-TTFT" and err["code"] == "invalid_value"
    assert "give its unit: ms or s" in err["message"]
    assert c.post(CHAT, json=BODY, headers={"X-LLMGW-SLO": "hard"}).get_json()["error"]["param"] == "X-LLMGW-SLO"
    assert up.stats["requests"] == 0


def test_a_strict_request_predicted_to_miss_is_refused_at_once_and_counted(store, upstreams):  # noqa: F811
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    learned(gw, e1=Speed(1.0, 0.1, ttfb=0.8, per_token=0.02))  # its first byte takes 800 ms
    t0 = time.monotonic()
    r = c.post(CHAT, json=BODY, headers={"X-LLMGW-TTFT": "300ms", "X-LLMGW-SLO": "strict"})
    took = time.monotonic() - t0
    err = r.get_json()["error"]
    assert r.status_code == 429 and err["code"] == "overloaded" and int(r.headers["Retry-After"]) >= 1
    assert "cannot serve this request within its latency targets" in err["message"]
    assert "e1, predicts its first byte in 800 ms (target 300 ms)" in err["message"]
    assert up.stats["requests"] == 0 and took < 1.0
    # the same request, not strict, is served where it misses least (the only endpoint), and counted as missed
    r = c.post(CHAT, json=BODY, headers={"X-LLMGW-TTFT": "300ms"})
    assert r.status_code == 200 and r.get_data(as_text=True).rstrip().endswith("data: [DONE]")
    page = c.get("/metrics").get_data(as_text=True)
    assert metric(page, 'llmgw_gateway_slo_requests_total{endpoint="",key="anonymous",model="m",outcome="refused"}') == 1
    assert metric(page, 'llmgw_gateway_shed_total{model="m",reason="slo_miss"}') == 1


def test_a_met_target_is_counted_beside_what_was_predicted_and_explained(store, upstreams):  # noqa: F811
    up = upstreams(tokens=8)
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    learned(gw, e1=Speed(0.02, 0.1, ttfb=0.002, per_token=0.002))
    _, key = store.create_key("team", slo_ttft=2.0)  # the key's default: first byte within 2 s
    gw.keys.refresh()
    r = c.post(CHAT, json=BODY, headers={"Authorization": f"Bearer {key}", "X-LLMGW-Explain": "1"})
    assert r.status_code == 200 and "[DONE]" in r.get_data(as_text=True)
    page = c.get("/metrics").get_data(as_text=True)
    assert metric(page, 'llmgw_gateway_slo_requests_total{endpoint="e1",key="team",model="m",outcome="met"}') == 1
    assert metric(page, 'llmgw_gateway_prediction_error_count{engine="sim",what="ttft"}') == 1
    assert metric(page, 'llmgw_gateway_prediction_error_count{engine="sim",what="tpot"}') == 1
    rec = c.get("/v1/llmgw/requests/" + r.headers["X-Request-Id"], headers={"Authorization": f"Bearer {key}"}).json
    (said,) = [s for s in rec["steps"] if s["kind"] == "targets"]
    assert said["targets"] == "ttft 2000ms" and said["missed"] == ""
    assert 0.002 <= said["predicted"] < 0.003  # its first byte, and the prefill of its short prompt
    assert any(line.startswith("Its latency targets were ttft 2000ms; the router predicted its first token 2 ms "
                               "after it was sent; it met them.") for line in rec["explanation"])
    # goodput reaches the key's usage (flushed as the background loop does)
    gw.usage.flush()
    usage = c.get("/v1/llmgw/usage", headers={"Authorization": f"Bearer {key}"}).json
    assert usage["usage"] == [{"model": "m", "prompt_tokens": 5, "completion_tokens": 8, "requests": 1,
                               "slo_requests": 1, "slo_met": 1}]


def test_a_request_without_targets_counts_no_goodput_but_its_prediction(store, upstreams):  # noqa: F811
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    learned(gw, e1=Speed(0.02, 0.1, ttfb=0.002, per_token=0.002))
    assert c.post(CHAT, json={"model": "m", "messages": BODY["messages"]}).status_code == 200
    page = c.get("/metrics").get_data(as_text=True)
    assert "llmgw_gateway_slo_requests_total{" not in page
    assert metric(page, 'llmgw_gateway_prediction_error_count{engine="sim",what="total"}') == 1
