"""How a request that asked to be explained was served: the Recorder over the trace's hooks, the log,
the record's JSON and its sentences (llmgw.state.served, gateway.observe.explain)."""

from __future__ import annotations

from gateway.observe.explain import ENVIRON_HEADER, ExplainLog, Explaining, Recorder, explained_wsgi
from llmgw.state.records import EndpointInfo
from llmgw.state.served import Served, recordable, routing_fields, sentences
from llmgw.tracing import NOOP_REQUEST, OFF

NOTE = ('matched=64/80 tokens; endpoint_hit=0.80; saved_ms=12.5; via=sent; expected_ms=420; ahead=2; '
        'backlog_ms=30; held_ms=0; rule="least_cost, prefix"; runner_up=r2; runner_up_ms=980; runner_up_matched=0')
EPS = {"r1": EndpointInfo("r1", "http://a:1", ("m",), "vllm", node="n1"),
       "r2": EndpointInfo("r2", "http://b:1", ("m",), "sim", node="n2")}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def recorder(log, clock, inner=NOOP_REQUEST, rid="rid-1", owner=("team", "k-team")):
    return Recorder(inner, rid, "/v1/chat/completions", log, lambda: 1_700_000_000.0, clock, EPS.get,
                    lambda: owner)


def test_a_resumed_stream_is_written_down_step_by_step():
    log, clock = ExplainLog(), Clock()
    rec = recorder(log, clock)
    rec.identify("m", "team", "standard")
    rec.admitting(0)
    rec.queued(1)
    clock.t += 0.25
    rec.dequeued("admitted")
    rec.choice("r1", "least_cost, prefix", False)
    rec.attempt(0, "r1", "http://a:1/v1/chat/completions")
    rec.answered([("Content-Type", "text/event-stream"), ("X-LLMGW-Endpoint", "r1"), ("X-LLMGW-Prefix", NOTE)])
    clock.t += 0.1
    rec.first_byte()
    assert log.take() == []  # not ended yet
    rec.attempt_failed("broken:reset", None, True)
    rec.choice("r2", "least_cost", False)
    rec.attempt(1, "r2", "http://b:1/v1/chat/completions")
    clock.t += 1.0
    rec.finish(200, True, (80, 12))
    [got] = log.take()
    assert got.served_by == {"endpoint": "r2", "replica": "r2", "node": "n2", "engine": "sim"}
    assert (got.status, got.completed, got.usage, got.key, got.key_id) == (200, True, (80, 12), "team", "k-team")
    assert got.first_byte == 0.35 and got.seconds == 1.35 and got.header_endpoint == "r1"
    assert [s["kind"] for s in got.steps] == ["queued", "dequeued", "choice", "attempt", "failed", "choice", "attempt"]
    assert Served.from_json(got.to_json()) == got
    text = "\n".join(sentences(got))
    assert "waited in the model's queue (position 1)" in text and "after 250 ms: admitted" in text
    assert "Attempt 1 went to replica r1 on node n1 (vllm)" in text
    assert "broke off after the first byte (reset): the answer went on from another replica" in text
    assert "Served by replica r2 on node n2 (sim): HTTP 200, 80 prompt and 12 completion tokens" in text
    assert 'Routed to r1 by the rule "least_cost, prefix": expected prefix-cache hit 80%: 64 of 80 prompt tokens' in text
    assert "2 request(s) already there, 30 ms of prefill queued" in text
    assert "Next came r2, expected cost 980 ms, expected to hold 0 prompt tokens." in text
    assert log.get("rid-1") == got


def test_a_whole_answer_ends_before_its_head_goes_out_and_is_recorded_once_both_are_known():
    log, clock = ExplainLog(), Clock()
    rec = recorder(log, clock, owner=("", ""))
    rec.identify("m", None, "standard")
    rec.attempt(0, "r1", "u")
    rec.finish(200, True, None)
    assert log.take() == []
    rec.answered([("X-LLMGW-Endpoint", "r1"), ("X-LLMGW-Prefix", NOTE)])
    [got] = log.take()
    assert got.routing == NOTE and got.key == "" and got.key_id == ""
    rec.finish(200, True, None)
    rec.answered([])
    assert log.take() == []  # once


def test_a_refusal_names_no_replica():
    log, clock = ExplainLog(), Clock()
    rec = recorder(log, clock)
    rec.identify("m", "team", "standard")
    rec.refused(429, "shed", "every endpoint of m is saturated")
    rec.answered([("Retry-After", "1")])
    [got] = log.take()
    assert got.served_by == {} and got.error == "shed: every endpoint of m is saturated"
    assert "The gateway answered HTTP 429 itself: shed: every endpoint of m is saturated." in sentences(got)


def test_the_hooks_reach_the_real_trace():
    calls = []

    class Inner:
        on = True

        def __getattr__(self, name):
            return lambda *a: calls.append(name)

    rec = recorder(ExplainLog(), Clock(), inner=Inner())
    rec.identify("m", None, "standard")
    rec.choice("r1", "x", False)
    rec.attempt(0, "r1", "u")
    rec.inject({})
    rec.first_byte()
    rec.finish(200, True, None)
    assert calls == ["identify", "choice", "attempt", "inject", "first_byte", "finish"] and rec.on


def test_only_a_request_that_asks_with_a_plain_id_gets_a_recorder_owned_by_the_key_it_sent():
    log = ExplainLog()
    ex = Explaining(OFF, log, lambda: 0.0, lambda: 0.0, EPS.get, lambda k: ("team", "k-1") if k == "sk-1" else ("", ""))
    assert ex.request({}, "abc", "POST", "/v1/chat/completions") is NOOP_REQUEST
    assert ex.request({ENVIRON_HEADER: "1"}, "a b/../c", "POST", "/x") is NOOP_REQUEST
    for environ, owner in (({"HTTP_AUTHORIZATION": "Bearer sk-1"}, ("team", "k-1")), ({"HTTP_API_KEY": "sk-1"}, ("team", "k-1")),
                           ({"HTTP_AUTHORIZATION": "Bearer sk-2"}, ("", "")), ({}, ("", ""))):
        rec = ex.request({ENVIRON_HEADER: "1", **environ}, "abc", "POST", "/v1/chat/completions")
        assert isinstance(rec, Recorder)
        rec.refused(401, "unauthorized", "no")  # refused before its key was read: still its key's record
        rec.answered([])
        got = log.take()[0]
        assert (got.key, got.key_id) == owner
    assert recordable("0f" * 16) and not recordable("x" * 129) and not recordable("")


def test_the_wsgi_wrapper_hands_the_head_to_the_recorder_and_leaves_other_requests_alone():
    log, clock = ExplainLog(), Clock()
    rec = recorder(log, clock)
    seen = []

    def app(environ, start_response):
        environ["llmgw.trace"] = rec
        rec.finish(200, True, None)
        start_response("200 OK", [("X-LLMGW-Endpoint", "r1")])
        return [b"{}"]

    def start(status, headers, exc_info=None):
        seen.append(status)

    wsgi = explained_wsgi(app)
    assert wsgi({ENVIRON_HEADER: "1"}, start) == [b"{}"] and seen == ["200 OK"]
    assert log.take()[0].header_endpoint == "r1"
    plain = {}
    assert explained_wsgi(lambda e, s: (s("204 No Content", []), [b""])[1])(plain, start) == [b""]


def test_routing_fields_read_the_header():
    f = routing_fields(NOTE)
    assert f["matched"] == "64/80 tokens" and f["endpoint_hit"] == "0.80" and f["rule"] == "least_cost, prefix"
    assert routing_fields("") == {}


def test_a_malformed_record_is_refused_with_a_reason():
    import pytest

    for blob in ("{", "[]", '{"ts": 1}', '{"id": "x", "ts": "soon"}'):
        with pytest.raises(ValueError, match="request record"):
            Served.from_json(blob)


def test_the_log_keeps_a_bounded_number_of_recent_records():
    log = ExplainLog(recent=2)
    for i in range(3):
        log.add(Served(id=f"r{i}", ts=0.0, route="/v1/chat/completions"))
    assert log.get("r0") is None and log.get("r2") is not None and len(log.take()) == 3
