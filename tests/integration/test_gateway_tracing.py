"""Tracing through the real gateway app (llmgw.tracing, docs/tracing.md) in front of real sim engines
that log the headers they get: a proxied request retried after a refused connection is one trace
(the client's), with its admissions, endpoint choices and both attempts, and the engine is handed the
answering attempt's span as its parent; with tracing off the client's context is passed on as it was
sent, and nothing is added. One test runs the gateway under gunicorn and reads its OTLP export: each
worker configures tracing from the OpenTelemetry environment."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from opentelemetry.trace import SpanKind, StatusCode

from llmgw.state.records import LoadRecord
from llmgw.tracing import OFF
from tests.support.otlp import attribute, collector, roots  # noqa: F401 - collector: a fixture
from tests.support.gateway_app import CHAT, NEVER_STALE, dead_url, endpoint, make_app, server, store  # noqa: F401 - fixtures
from harness.procs import ProcessSet, free_port, python, wait_until

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TP = f"00-{TRACE}-{CLIENT_SPAN}-01"
STATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def sim(procs, name="sim"):
    """A sim engine serving `served-m` that logs every request's headers."""
    port = free_port()
    p = procs.start(name, [python(), "-m", "simengine", "--host", "127.0.0.1", "--port", str(port),
                           "--served-model-name", "served-m", "--log-headers", "--step-ms", "1"])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15, what=f"sim /health\n{p.log()}")
    return p, url


def logged_headers(p, rid: str) -> dict[str, str]:
    """The headers the engine logged for the request `rid` (lowercase names)."""
    for line in p.log().splitlines():
        if "headers of POST /v1/chat/completions:" in line and f"X-Request-Id: {rid}" in line.replace("x-request-id", "X-Request-Id"):
            fields = line.split("headers of POST /v1/chat/completions: ", 1)[1].split(" | ")
            return {k.lower(): v for k, _, v in (f.partition(": ") for f in fields)}
    return {}


def engine_saw(p, rid: str) -> dict[str, str]:
    wait_until(lambda: logged_headers(p, rid), 5, what=f"the engine's log of request {rid}\n{p.log()}")
    return logged_headers(p, rid)


@pytest.fixture
def procs(tmp_path):
    ps = ProcessSet(tmp_path / "logs")
    yield ps
    ps.stop_all()



def test_a_retried_request_is_one_trace_and_the_engine_gets_the_answering_attempt_as_parent(procs, store, traced):
    t, exporter = traced
    p, url = sim(procs)
    # The dead endpoint is in the higher tier, so it is tried first; the refused connect is retried.
    eps = [endpoint("dead", dead_url(), priority=1), endpoint("sim", url)]
    _, gw, c = make_app(store, eps, retries=2, tracing=t)
    _, key = store.create_key("alice")  # a named key: its name is on the span, never the key
    gw.keys.refresh()
    r = c.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
               headers={"traceparent": TP, "tracestate": STATE, "X-Request-Id": "rid-retry",
                        "Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.headers["X-LLMGW-Endpoint"] == "sim"
    spans = exporter.get_finished_spans()
    assert {s.context.trace_id for s in spans} == {int(TRACE, 16)}  # one trace: the client's
    by = {}
    for s in spans:
        by.setdefault(s.name, []).append(s)
    (root,) = by["POST /v1/chat/completions"]
    assert root.kind == SpanKind.SERVER and root.parent.is_remote and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert root.attributes["gen_ai.request.model"] == "m" and root.attributes["llmgw.key.name"] == "alice"
    assert root.attributes["llmgw.priority"] == "standard" and root.attributes["llmgw.request_id"] == "rid-retry"
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["llmgw.completed"] is True
    assert root.attributes["gen_ai.usage.output_tokens"] == 3 and root.attributes["gen_ai.usage.input_tokens"] > 0
    assert root.status.status_code == StatusCode.UNSET
    assert key not in repr([dict(s.attributes) for s in spans])
    # one admission per routing try, each with its choice under it
    admissions = sorted(by["llmgw.admission"], key=lambda s: s.start_time)
    choices = sorted(by["llmgw.endpoint_choice"], key=lambda s: s.start_time)
    assert len(admissions) == 2 and len(choices) == 2
    assert all(a.parent.span_id == root.context.span_id for a in admissions)
    assert [c.parent.span_id for c in choices] == [a.context.span_id for a in admissions]
    assert [c.attributes["llmgw.endpoint"] for c in choices] == ["dead", "sim"]
    assert all(c.attributes["llmgw.route.reason"] for c in choices)
    assert [a.attributes["llmgw.admission.decision"] for a in admissions] == ["send", "send"]
    # both attempts, siblings under the request
    first, second = sorted(by["llmgw.upstream_attempt"], key=lambda s: s.start_time)
    assert first.kind == second.kind == SpanKind.CLIENT
    assert first.parent.span_id == second.parent.span_id == root.context.span_id
    assert dict(first.attributes) == {"llmgw.attempt": 0, "llmgw.endpoint": "dead",
                                      "url.full": first.attributes["url.full"], "llmgw.outcome": "connect_error",
                                      "llmgw.retried": True}
    assert first.status.status_code == StatusCode.ERROR
    assert second.attributes["llmgw.attempt"] == 1 and second.attributes["llmgw.endpoint"] == "sim"
    assert second.attributes["url.full"] == url + "/v1/chat/completions"
    assert second.attributes["llmgw.outcome"] == "answer" and second.attributes["http.response.status_code"] == 200
    assert [e.name for e in second.events] == ["first_byte"] and not first.events
    assert second.status.status_code == StatusCode.UNSET
    # the engine's parent is the attempt that reached it; the client's tracestate goes along
    saw = engine_saw(p, "rid-retry")
    assert saw["traceparent"] == f"00-{TRACE}-{second.context.span_id:016x}-01"
    assert saw["tracestate"] == STATE
    assert key not in p.log()


def test_a_stream_records_its_first_byte_and_a_request_without_context_starts_a_trace(procs, store, traced):
    t, exporter = traced
    p, url = sim(procs)
    _, gw, c = make_app(store, [endpoint("sim", url)], tracing=t)
    r = c.post(CHAT, json={"model": "m", "stream": True, "max_tokens": 4, "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": "hi"}]}, headers={"X-Request-Id": "rid-s"})
    assert r.status_code == 200 and b"[DONE]" in r.data
    wait_until(lambda: any(s.name.startswith("POST") for s in exporter.get_finished_spans()), 5, what="the trace's end")
    by = {s.name: s for s in exporter.get_finished_spans()}
    root, up = by["POST /v1/chat/completions"], by["llmgw.upstream_attempt"]
    assert root.parent is None  # no client context: the gateway started the trace
    assert [e.name for e in root.events] == ["first_byte"] and [e.name for e in up.events] == ["first_byte"]
    assert root.attributes["gen_ai.usage.output_tokens"] == 4 and root.attributes["llmgw.completed"] is True
    assert "llmgw.key.name" not in root.attributes  # no key, no name
    saw = engine_saw(p, "rid-s")
    assert saw["traceparent"] == f"00-{root.context.trace_id:032x}-{up.context.span_id:016x}-01"
    assert "tracestate" not in saw


def test_a_refused_request_ends_its_trace_with_the_error(store, traced):
    t, exporter = traced
    _, gw, c = make_app(store, [endpoint("dead", dead_url())], retries=0, tracing=t)
    r = c.post(CHAT, json={"model": "m"}, headers={"traceparent": TP})
    assert r.status_code == 503
    by = {s.name: s for s in exporter.get_finished_spans()}
    root, up = by["POST /v1/chat/completions"], by["llmgw.upstream_attempt"]
    assert root.attributes["error.type"] == "no_replica" and root.attributes["http.response.status_code"] == 503
    assert root.status.status_code == StatusCode.ERROR
    assert up.attributes["llmgw.outcome"] == "connect_error" and up.attributes["llmgw.retried"] is False
    assert len(exporter.get_finished_spans()) == 4  # request, admission, choice, attempt: each ended once
    r = c.post(CHAT, json={"model": "nope"})
    assert r.status_code == 404
    unknown = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")][-1]
    assert unknown.attributes["error.type"] == "model_not_found" and unknown.attributes["llmgw.completed"] is False
    assert unknown.status.status_code == StatusCode.UNSET  # a 4xx is the client's


def test_tracing_off_passes_a_valid_client_context_on_unchanged_and_adds_nothing(procs, store):
    p, url = sim(procs)
    _, gw, c = make_app(store, [endpoint("sim", url)], tracing=OFF)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    odd = " a=1 ,, B=not-a-valid-member"  # passed on as sent: this gateway does not take part
    cases = {
        "rid-valid": ({"traceparent": TP, "tracestate": odd}, {"traceparent": TP, "tracestate": odd.strip()}),
        "rid-none": ({}, {}),
        "rid-bad": ({"traceparent": TP.upper(), "tracestate": STATE}, {}),  # invalid: neither goes on
    }
    for rid, (sent, _) in cases.items():
        assert c.post(CHAT, json=body, headers={**sent, "X-Request-Id": rid}).status_code == 200
    for rid, (_, expected) in cases.items():
        saw = engine_saw(p, rid)
        assert {k: v for k, v in saw.items() if k in ("traceparent", "tracestate")} == expected, (rid, saw)


# --- under gunicorn, exported over OTLP ---------------------------------------------------------------
def test_gunicorn_workers_export_the_requests_they_serve_over_otlp(cluster, collector):
    cluster.start_redis()
    p, url = sim(cluster.procs)
    cluster.store().write_endpoints([endpoint("sim", url)], "fp-sim", time.time())
    gw = cluster.start_gateway(OTEL_EXPORTER_OTLP_ENDPOINT=collector.url, OTEL_BSP_SCHEDULE_DELAY="50",
                               LLMGW_GATEWAY_WORKERS="2")
    wait_until(lambda: requests.get(gw + "/healthz", timeout=2).json().get("endpoints") == 1, 10, what="endpoints")
    rids = [f"rid-gunicorn-{i}" for i in range(6)]
    for i, rid in enumerate(rids):  # odd ones streamed: relayed to the socket by the gevent worker
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": bool(i % 2)}
        r = requests.post(gw + CHAT, json=body, headers={"traceparent": TP, "X-Request-Id": rid, "Connection": "close"},
                          timeout=10)
        assert r.status_code == 200, r.text

    wait_until(lambda: set(rids) <= set(roots(collector.spans)), 10, what=f"the requests' spans at the collector ({len(collector.spans)})")
    for rid, (service, span) in roots(collector.spans).items():
        assert service == "llmgw-gateway"
        assert span.trace_id.hex() == TRACE and span.parent_span_id.hex() == CLIENT_SPAN
        saw = engine_saw(p, rid)
        attempt = [s for _, s in collector.spans if s.name == "llmgw.upstream_attempt" and s.trace_id == span.trace_id
                   and s.parent_span_id == span.span_id]
        assert len(attempt) == 1 and saw["traceparent"] == f"00-{TRACE}-{attempt[0].span_id.hex()}-01"
        assert attribute(span, "llmgw.completed") is True and attribute(span, "http.response.status_code") == 200
        assert [e.name for e in span.events] == ["first_byte"]


def test_a_queued_request_shows_its_wait_and_how_it_ended(store, upstreams, traced):
    t, exporter = traced
    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url)], queue_timeout=0.3, routing=NEVER_STALE, tracing=t)
    store.write_load(LoadRecord("e1", time.time(), True, running=4, waiting=9))  # saturated
    gw.pollers.refresh_loads()
    assert c.post(CHAT, json={"model": "m"}, headers={"X-Request-Id": "rid-timeout"}).status_code == 429

    def spans_of(rid):
        roots = [s for s in exporter.get_finished_spans() if s.attributes.get("llmgw.request_id") == rid]
        if not roots:
            return {}
        trace_id = roots[0].context.trace_id
        return {s.name: s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id}

    s = spans_of("rid-timeout")
    wait, adm = s["llmgw.queue_wait"], s["llmgw.admission"]
    assert wait.parent.span_id == adm.context.span_id
    assert dict(wait.attributes) == {"llmgw.queue.position": 1, "llmgw.queue.outcome": "timeout"}
    assert adm.attributes["llmgw.admission.decision"] == "shed" and "llmgw.upstream_attempt" not in s
    assert s["POST /v1/chat/completions"].attributes["error.type"] == "shed"
    # a wait that ends with an endpoint free: admitted, and the admission says it waited
    _, gw, c = make_app(store, [endpoint("e1", up.url)], queue_timeout=30, routing=NEVER_STALE, tracing=t)
    gw.pollers.refresh_loads()
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("r", c.post(CHAT, json={"model": "m"},
                                                                       headers={"X-Request-Id": "rid-wait"})))
    th.start()
    try:
        wait_until(lambda: len(gw.queues.get("m")) == 1, 5, what="the request to queue")
        store.write_load(LoadRecord("e1", time.time(), True, running=0, waiting=0))
        gw.pollers.refresh_loads()
        gw.queues.wake()
    finally:
        th.join(15)
    assert got["r"].status_code == 200
    s = spans_of("rid-wait")
    assert s["llmgw.queue_wait"].attributes["llmgw.queue.outcome"] == "admitted"
    assert s["llmgw.admission"].attributes["llmgw.admission.decision"] == "wait"
    assert s["llmgw.endpoint_choice"].attributes["llmgw.endpoint"] == "e1"
    assert s["llmgw.upstream_attempt"].attributes["llmgw.outcome"] == "answer"
