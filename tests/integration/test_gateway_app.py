"""The gateway's views on fakeredis and in-process fake engines: the error table, forwarding,
retries, admission, keys and limits, and serving through a Redis outage."""

import json
import time

import pytest

from llmgw.state import keys
from llmgw.state.records import LoadRecord
from tests.support.gateway_app import (  # noqa: F401 - server, store: fixtures
    CHAT,
    NEVER_STALE,
    dead_url,
    endpoint,
    make_app,
    metric,
    server,
    store,
    wall_clock,
)


def test_forwards_rewrites_model_and_passes_request_id(store, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    r = c.post(CHAT, json={"model": "m-alias", "messages": []},
               headers={"X-Request-Id": "rid-1", "Authorization": "Bearer secret", "Connection": "close"})
    assert r.status_code == 200
    assert r.headers["X-Request-Id"] == "rid-1" and r.headers["X-LLMGW-Endpoint"] == "e1"
    assert up.stats["models_seen"] == ["served-m"] and up.stats["request_ids"] == ["rid-1"]
    assert r.json["usage"]["completion_tokens"] == 8
    # the answer was learned from once, at its end; the speed is derived on the next load refresh
    assert gw.router.inflight["e1"] == 0 and gw.router.learning.learned["e1"].per_request.w == 1
    gw.pollers.refresh_loads()
    assert gw.router.stats["e1"].speed.decode1 > 0
    gw.usage.flush()
    assert store.r.hgetall(keys.usage("anonymous")) == {"m:prompt": "5", "m:completion": "8", "m:requests": "1"}
    r = c.post(CHAT, json={"model": "m", "messages": []})
    assert "X-Request-Id" in r.headers and len(r.headers["X-Request-Id"]) >= 16


def test_streaming_is_passed_through(store, upstreams):
    up = upstreams(tokens=5)
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    r = c.post(CHAT, json={"model": "m", "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in r.data.split(b"\n") if line.startswith(b"data:")]
    assert len(events) == 7 and events[-1] == b"data: [DONE]"
    gw.usage.flush()
    assert store.r.hget(keys.usage("anonymous"), "m:completion") == "5"


@pytest.mark.parametrize(
    "kwargs, status, code",
    [
        ({"data": "{not json"}, 400, "invalid_request"),
        ({"json": [1, 2]}, 400, "invalid_request"),
        ({"json": {"messages": []}}, 400, "model_required"),
        ({"json": {"model": ""}}, 400, "model_required"),
        ({"json": {"model": "nope"}}, 404, "model_not_found"),
        ({"json": {"model": "m"}, "headers": {"X-LLMGW-Priority": "urgent"}}, 400, "invalid_request"),
        ({"data": "x" * 5000}, 413, "request_too_large"),
        ({"data": b'{"model": "m\xff"}'}, 400, "invalid_request"),  # not UTF-8
        # Deeper than the JSON parser's stack: found by tests/faults/test_requests.py (it was a 500).
        ({"data": '{"model": "m", "x": ' + "[" * 2000 + "]" * 2000 + "}"}, 400, "invalid_request"),
    ],
)
def test_error_table(store, upstreams, kwargs, status, code):
    up = upstreams()
    _, _, c = make_app(store, [endpoint("e1", up.url)], max_body_bytes=4096)
    r = c.post(CHAT, **kwargs)
    assert r.status_code == status
    assert r.json["error"]["code"] == code and r.json["error"]["message"] and r.json["error"]["type"]


def test_a_body_shorter_than_its_content_length_is_a_400_and_not_forwarded(store, upstreams):
    # Found by tests/faults/test_requests.py: a client that half-closed after 66 of 67 declared bytes
    # had what arrived forwarded as if it were the whole request.
    up = upstreams()
    _, _, c = make_app(store, [endpoint("e1", up.url)])
    body = b'{"model": "m", "messages": []}'
    r = c.post(CHAT, data=body, content_type="application/json",
               environ_overrides={"CONTENT_LENGTH": str(len(body) + 1)})
    assert r.status_code == 400 and r.json["error"]["code"] == "invalid_request"
    assert f"ended after {len(body)} of the {len(body) + 1} bytes" in r.json["error"]["message"]
    assert c.post(CHAT, data=body, content_type="application/json").status_code == 200


def test_503_when_model_known_but_no_ready_endpoint(store, upstreams):
    up = upstreams()
    store.r.set(keys.CATALOG, json.dumps({"version": 1, "spec": {"models": [{"name": "m"}]}}))
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    store.write_endpoints([], "fp2", time.time())
    gw.pollers.refresh_endpoints()
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 503 and r.json["error"]["code"] == "no_ready_replica"
    # a model in the catalog but never published is also 503, not 404
    store.r.set(keys.CATALOG, json.dumps({"version": 2, "spec": {"models": [{"name": "cat", "aliases": ["c2"]}]}}))
    gw.pollers.refresh_endpoints(force=True)
    assert c.post(CHAT, json={"model": "c2"}).status_code == 503
    # ... and a model that left the catalog, once unpublished, is unknown again: 404
    assert c.post(CHAT, json={"model": "m"}).status_code == 404


def test_unexpected_error_is_a_clean_500(store, upstreams, monkeypatch):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    monkeypatch.setattr(gw.router, "route", lambda req: 1 / 0)
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 500 and r.json["error"]["code"] == "internal_error"
    assert "Traceback" not in r.get_data(as_text=True)


def test_retries_on_refused_connection_and_5xx(store, upstreams):
    good, bad = upstreams(), upstreams(fail_status=503)
    eps = [endpoint("dead", dead_url()), endpoint("bad", bad.url), endpoint("good", good.url)]
    _, gw, c = make_app(store, eps, retries=2)
    for _ in range(10):
        r = c.post(CHAT, json={"model": "m"})
        assert r.status_code == 200 and r.headers["X-LLMGW-Endpoint"] == "good"
    assert all(v == 0 for v in gw.router.inflight.values())
    # both failing endpoints were really tried (and each failure retried), not just skipped
    assert bad.stats["requests"] > 0 and good.stats["requests"] == 10
    text = c.get("/metrics").get_data(as_text=True)
    assert metric(text, 'llmgw_gateway_upstream_errors_total{endpoint="dead",kind="connect"}') >= 1
    assert metric(text, 'llmgw_gateway_upstream_errors_total{endpoint="bad",kind="503"}') == bad.stats["requests"]
    assert metric(text, 'llmgw_gateway_retries_total{model="m"}') >= 1 + bad.stats["requests"]
    _, _, c0 = make_app(store, [endpoint("dead", dead_url())], retries=0)
    r = c0.post(CHAT, json={"model": "m"})
    assert r.status_code == 503 and r.json["error"]["code"] == "no_ready_replica"


# llama-server's error answer (b11434, as it sends it: a number for `code`, and an empty CORS header).
LLAMA_400 = b'{"error":{"code":400,"message":"Expected \'messages\' to be an array","type":"invalid_request_error"}}'
LLAMA_HEADERS = (("Access-Control-Allow-Origin", ""),)


def test_an_engines_empty_header_is_not_passed_on(store, upstreams):
    up = upstreams(headers=LLAMA_HEADERS + (("X-Engine-Note", "kept"),))
    _, _, c = make_app(store, [endpoint("e1", up.url)])
    for path, body in ((CHAT, {"model": "m"}), ("/v1/embeddings", {"model": "m", "input": "x"})):
        r = c.post(path, json=body)
        assert r.status_code == 200 and r.headers["X-Engine-Note"] == "kept"
        assert "Access-Control-Allow-Origin" not in r.headers, path


def test_an_engines_error_has_the_gateways_shape_and_a_4xx_is_not_held_against_it(store, upstreams):
    bad = upstreams(fail_status=400, fail_body=LLAMA_400, fail_type="application/json; charset=utf-8",
                    headers=LLAMA_HEADERS)
    _, gw, c = make_app(store, [endpoint("e1", bad.url)], retries=2)
    t0 = time.time()
    for stream in (False, True):
        r = c.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
        assert r.status_code == 400 and r.headers["X-LLMGW-Endpoint"] == "e1"
        assert r.json == {"error": {"message": "Expected 'messages' to be an array", "type": "invalid_request_error",
                                    "code": "invalid_request"}}
        assert r.headers["Content-Type"] == "application/json"
        assert r.headers["Content-Length"] == str(len(r.get_data()))
        assert "Access-Control-Allow-Origin" not in r.headers  # llama-server's empty one says nothing
    assert bad.stats["requests"] == 2  # a 4xx is the client's: never retried elsewhere
    # ... nor evidence against the endpoint: it answered (ok_at), it never failed (fail_at), it is not
    # passed over, the model's charts count no error, and no upstream error is counted.
    facts = gw.exchange.report_facts()
    ok_at, fail_at = facts.ok_at, facts.fail_at
    assert ok_at["e1"] >= t0 and "e1" not in fail_at
    assert gw.router.stats.get("e1") is None or gw.router.stats["e1"].down_until <= time.monotonic()
    counted = {k.split(":", 1)[1]: n for slot in gw.traffic.take().values() for k, n in slot.items()}
    assert counted["n"] == 2 and "err" not in counted
    assert "llmgw_gateway_upstream_errors_total{" not in c.get("/metrics").get_data(as_text=True)
    # An engine that refuses the gateway's own credential is the gateway's failure: 502, not 401.
    locked = upstreams(require_key="not-the-gateways")
    _, _, c = make_app(store, [endpoint("e2", locked.url)])
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 502 and r.json["error"]["code"] == "upstream_error"
    assert r.json["error"]["message"] == ("endpoint e2 refused the gateway's credential (HTTP 401): "
                                          "missing or wrong API key")


def test_upstream_timeout_is_504(store, upstreams):
    slow = upstreams(base=2.0)
    _, _, c = make_app(store, [endpoint("e1", slow.url)], first_byte_timeout=0.2, retries=0)
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 504 and r.json["error"]["code"] == "upstream_timeout"


def test_shedding_by_priority(store, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], queue_timeout=0.2, routing=NEVER_STALE)
    store.write_load(LoadRecord("e1", time.time(), True, running=4, waiting=9))
    gw.pollers.refresh_loads()
    r = c.post(CHAT, json={"model": "m"}, headers={"X-LLMGW-Priority": "sheddable"})
    assert r.status_code == 429 and r.json["error"]["code"] == "overloaded" and int(r.headers["Retry-After"]) >= 1
    t0 = time.monotonic()
    r = c.post(CHAT, json={"model": "m"})  # standard: waits in the queue, then 429
    assert r.status_code == 429 and time.monotonic() - t0 >= 0.2 and "Retry-After" in r.headers
    r = c.post(CHAT, json={"model": "m"}, headers={"X-LLMGW-Priority": "critical"})
    assert r.status_code == 200
    # once the engine drains, standard goes through again
    store.write_load(LoadRecord("e1", time.time(), True, running=0, waiting=0))
    gw.pollers.refresh_loads()
    assert c.post(CHAT, json={"model": "m"}).status_code == 200


def test_keys_required_once_one_exists_and_rpm_limit(store, upstreams):
    up = upstreams()
    clock = wall_clock()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock)
    assert c.post(CHAT, json={"model": "m"}).status_code == 200  # no keys yet: open
    _, key = store.create_key("team-a", rpm=3, priority="sheddable")
    gw.keys.refresh()
    assert c.post(CHAT, json={"model": "m"}).json["error"]["code"] == "invalid_api_key"
    assert c.post(CHAT, json={"model": "m"}, headers={"Authorization": "Bearer nope"}).status_code == 401
    auth = {"Authorization": f"Bearer {key}"}
    assert [c.post(CHAT, json={"model": "m"}, headers=auth).status_code for _ in range(4)] == [200, 200, 200, 429]
    r = c.post(CHAT, json={"model": "m"}, headers=auth)
    assert r.json["error"]["code"] == "rate_limit_exceeded" and int(r.headers["Retry-After"]) == 40  # to :00
    clock.t += 40  # the next minute: a fresh window
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 200
    assert c.get("/v1/models").status_code == 401 and c.get("/v1/models", headers=auth).status_code == 200
    # only the hash is stored
    assert key not in json.dumps(store.r.hgetall(keys.API_KEYS))
    store.revoke_key("team-a")
    gw.keys.refresh()
    # auto stays closed once a key was seen: an empty table may be Redis restarted without its data
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 401
    assert c.post(CHAT, json={"model": "m"}).status_code == 401


def test_tpm_limit_counts_reported_tokens(store, upstreams):
    up = upstreams()  # 13 tokens per request
    clock = wall_clock()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock)
    _, key = store.create_key("t", tpm=20)
    gw.keys.refresh()
    auth = {"Authorization": f"Bearer {key}"}
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 200
    gw.usage.flush()
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 200
    gw.usage.flush()
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 429
    clock.t += 60  # the tokens counted against the last minute only
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 200


def test_keeps_serving_while_redis_is_down(store, server, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)])
    _, key = store.create_key("k", rpm=1000)
    gw.keys.refresh()
    auth = {"Authorization": f"Bearer {key}"}
    server.connected = False
    gw.refresh()
    for _ in range(3):
        assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 200
    h = c.get("/healthz").json
    assert h["redis"] == "unavailable" and h["endpoints"] == 1
    assert b"llmgw_gateway_redis_unavailable 1.0" in c.get("/metrics").data
    gw.usage.flush()  # kept for later
    server.connected = True
    gw.refresh()
    gw.usage.flush()
    assert c.get("/healthz").json["redis"] == "ok"
    assert store.r.hget(keys.usage("k-" + store.r.hkeys(keys.API_KEYS)[0][2:]), "m:requests") == "3"


def test_service_time_learned_from_token_counters(store, upstreams):
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url), endpoint("e2", up.url)])
    for _ in range(3):  # 8 tokens per answer; session "a" hashes to e1, so e2 is never served here
        assert c.post(CHAT, json={"model": "m"}, headers={"X-Session-ID": "a"}).headers["X-LLMGW-Endpoint"] == "e1"
    assert "e1" in gw.router.learning.learned and "e2" not in gw.router.learning.learned
    t0 = time.time()
    for i in range(3):  # two intervals that agree: the estimate is not mistaken for noise
        store.write_load(LoadRecord("e2", t0 - 2 + i, True, running=2, waiting=0, generation_tokens_total=100 + 32 * i))
        gw.pollers.refresh_loads()
    # 32 tokens in 1 s over 2 running sequences: 16 tokens/s each; 8 tokens per answer = 0.5 s
    assert gw.router.stats["e2"].speed.decode(2) == pytest.approx(0.5, rel=0.01)  # (a hair toward e1: shrink)
    assert gw.router.stats["e2"].scrape_inflight == 0
