"""llmgw.tracing: W3C trace context, the environment's on/off decision, the request's spans, context
carried across processes, the off path, and greenlets. Spans are read back from the SDK's
in-memory exporter; one test exports over OTLP/HTTP to a local collector stand-in."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from llmgw import tracing
from llmgw.tracing import (
    NO_SPAN,
    NOOP_REQUEST,
    OFF,
    PassThrough,
    Tracing,
    carried,
    clean_tracestate,
    format_traceparent,
    forwardable,
    from_task,
    parse_traceparent,
    plan,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TP = f"00-{TRACE}-{PARENT}-01"
CHAT = ("POST", "/v1/chat/completions")



def spans_by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def hex_span(ctx) -> str:
    return f"{ctx.span_id:016x}"


# --- traceparent -------------------------------------------------------------------------------
@pytest.mark.parametrize("header,expected", [
    (TP, (0, TRACE, PARENT, 1)),
    (f"00-{TRACE}-{PARENT}-00", (0, TRACE, PARENT, 0)),
    (f"00-{TRACE}-{PARENT}-09", (0, TRACE, PARENT, 9)),  # unknown bits are read, sampled is bit 0
    (f" \t{TP} ", (0, TRACE, PARENT, 1)),  # optional whitespace around the value
    (f"cc-{TRACE}-{PARENT}-01", (0xcc, TRACE, PARENT, 1)),  # a higher version: its first four fields
    (f"cc-{TRACE}-{PARENT}-01-what-the-future-holds", (0xcc, TRACE, PARENT, 1)),
    (None, None),
    ("", None),
    (f"00-{TRACE.upper()}-{PARENT}-01", None),  # HEXDIGLC: lowercase only
    (f"00-{TRACE}-{PARENT.upper()}-01", None),
    (f"00-{'0' * 32}-{PARENT}-01", None),  # all-zero trace id
    (f"00-{TRACE}-{'0' * 16}-01", None),  # all-zero parent id
    (f"ff-{TRACE}-{PARENT}-01", None),  # version ff is forbidden
    (f"00-{TRACE}-{PARENT}-01-extra", None),  # version 00 is exactly 55 characters
    (f"00-{TRACE}-{PARENT}-010", None),
    (f"cc-{TRACE}-{PARENT}-01x", None),  # a higher version's flags end the value or meet a dash
    (f"00-{TRACE[:-1]}-{PARENT}-01", None),  # short trace id
    (f"00-{TRACE}-{PARENT[:-1]}-01", None),
    (f"00-{TRACE}-{PARENT}-1", None),
    (f"00-{TRACE}-{PARENT}-zz", None),  # flags are hex
    (f"0-{TRACE}-{PARENT}-01", None),
    (f"00_{TRACE}_{PARENT}_01", None),
    (f"{TP},{TP}", None),  # two headers joined by the server: not one value
    ("not a traceparent", None),
])
def test_traceparent_parsing_follows_the_spec(header, expected):
    got = parse_traceparent(header)
    assert (None if got is None else tuple(got)) == expected
    if got is not None:
        assert got.sampled == bool(expected[3] & 1)


def test_a_formatted_traceparent_parses_back():
    assert format_traceparent(int(TRACE, 16), int(PARENT, 16), True) == TP
    assert format_traceparent(TRACE, PARENT, False) == f"00-{TRACE}-{PARENT}-00"
    assert tuple(parse_traceparent(format_traceparent(1, 2, False))) == (0, f"{1:032x}", f"{2:016x}", 0)


# --- tracestate ----------------------------------------------------------------------------------
@pytest.mark.parametrize("header,expected", [
    ("congo=t61rcWkgMzE", "congo=t61rcWkgMzE"),
    ("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
    (" , rojo=1,,\t", "rojo=1"),  # empty and whitespace-only members are allowed, and dropped
    ("tenant@vendor=x,a_b-c*d/e=y", "tenant@vendor=x,a_b-c*d/e=y"),
    ("Rojo=1,congo=2", "congo=2"),  # keys are lowercase
    ("rojo=1,rojo=2", "rojo=1"),  # one entry per key: the leftmost is the latest
    ("rojo=a=b,congo=2", "congo=2"),  # '=' is not a value character
    ("rojo=,congo=2", "congo=2"),  # a value has at least one character
    ("rojo= lead,congo=2", "rojo= lead,congo=2"),  # leading spaces are part of the value
    ("rojo", None),
    ("", None),
    (None, None),
    (",".join(f"k{i}=v" for i in range(40)), ",".join(f"k{i}=v" for i in range(32))),  # at most 32
])
def test_tracestate_is_cleaned_member_by_member(header, expected):
    assert clean_tracestate(header) == expected


def test_a_long_tracestate_loses_its_longest_entries_first_then_from_the_end():
    long = "big=" + "x" * 200
    small = [f"k{i}=" + "v" * 40 for i in range(12)]  # 44 characters each
    got = clean_tracestate(",".join([small[0], long, *small[1:]]))
    assert "big=" not in got
    assert len(got) <= 512
    assert got.split(",") == small[:len(got.split(","))]  # order kept, the end dropped
    assert len(got.split(",")) == 11


def test_forwarding_passes_a_valid_context_unchanged_and_nothing_else():
    assert forwardable(TP, "congo=t61rcWkgMzE") == (TP, "congo=t61rcWkgMzE")
    assert forwardable(f" {TP}", None) == (TP, None)
    future = f"cc-{TRACE}-{PARENT}-01-later"
    assert forwardable(future, "Not=Our,Business") == (future, "Not=Our,Business")  # not ours to parse
    assert forwardable(f"00-{'0' * 32}-{PARENT}-01", "congo=1") is None
    assert forwardable(None, "congo=1") is None
    assert forwardable(TP, "congo=1\r\nX-Injected: yes") == (TP, None)  # never into a request head
    assert forwardable(f"cc-{TRACE}-{PARENT}-01-\r\nX: y", None) is None


# --- on or off, from the environment -----------------------------------------------------------
ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


@pytest.mark.parametrize("env,exporters,problem", [
    ({}, (), None),
    (ENDPOINT, ("otlp-http",), None),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ("otlp-http",), None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, (), None),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, (), None),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, ("otlp-http",), None),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, (), None),
    ({"OTEL_TRACES_EXPORTER": "console"}, ("console",), None),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "otlp,console"}, ("otlp-http", "console"), None),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("otlp-grpc",), None),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
     ("otlp-http",), None),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, (), "'http/json' is not supported"),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "zipkin"}, (), "'zipkin', which llmgw does not ship"),
])
def test_the_environment_decides_whether_spans_are_exported(env, exporters, problem):
    p = plan(env)
    assert p.exporters == exporters
    assert p.why
    if problem is None:
        assert p.problems == ()
    else:
        assert any(problem in text for text in p.problems), p.problems


def test_without_an_endpoint_tracing_is_off_and_opentelemetry_is_never_imported():
    code = (
        "import sys; from llmgw import tracing\n"
        "t = tracing.build('llmgw-test', {})\n"
        f"r = t.request({{'HTTP_TRACEPARENT': '{TP}'}}, 'rid', 'POST', '/v1/chat/completions')\n"
        "h = {}; r.attempt(0, 'ep', 'http://x'); r.inject(h); r.finish(200, True, None)\n"
        "with t.span('llmgw.reconcile') as s: s.set('k', 1)\n"
        "print(t is tracing.OFF, h == {'traceparent': '%s'}, any(m.startswith('opentelemetry') for m in sys.modules))\n"
        % TP
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True", "False"], out.stderr


class Collector(http.server.ThreadingHTTPServer):
    """Stands in for an OTLP/HTTP collector: keeps each request's path, headers and body."""

    daemon_threads = True

    def __init__(self):
        self.got: list[tuple[str, dict, bytes]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(h):  # noqa: N802, N805 - stdlib name; `h` is the handler, `self` the server
                body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
                self.got.append((h.path, {k.lower(): v for k, v in h.headers.items()}, body))
                h.send_response(200)
                h.send_header("Content-Type", "application/x-protobuf")
                h.send_header("Content-Length", "0")
                h.end_headers()

            def log_message(h, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def collector():
    c = Collector()
    t = threading.Thread(target=c.serve_forever, daemon=True)
    t.start()
    yield c
    c.shutdown()
    c.server_close()
    t.join(5)


@pytest.mark.parametrize("service_env,service", [({}, b"llmgw-test"), ({"OTEL_SERVICE_NAME": "gw-eu-1"}, b"gw-eu-1")])
def test_with_an_endpoint_spans_go_to_the_collector_over_otlp_http(collector, monkeypatch, service_env, service):
    for k in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in service_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.server_port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=llmgw")
    t = tracing.build("llmgw-test")
    assert isinstance(t, Tracing)
    with t.span("llmgw.reconcile", attributes={"llmgw.pass": "reconcile"}):
        pass
    assert t.provider.force_flush(10_000)
    t.shutdown()
    assert collector.got, "nothing reached the collector"
    path, headers, body = collector.got[0]
    assert path == "/v1/traces"
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["x-tenant"] == "llmgw"
    assert b"llmgw.reconcile" in body and service in body


# --- the request's spans -------------------------------------------------------------------------
def test_a_request_joins_the_clients_trace_and_names_its_attempt_to_the_engine(traced):
    t, exporter = traced
    env = {"HTTP_TRACEPARENT": TP, "HTTP_TRACESTATE": "congo=t61rcWkgMzE", "HTTP_AUTHORIZATION": "Bearer sk-secret"}
    r = t.request(env, "rid-1", *CHAT)
    r.identify("smollm2", "alice", "standard")
    r.admitting(0)
    r.choice("ep-1", "least expected completion", False)
    r.admitted("send")
    r.attempt(0, "ep-1", "http://127.0.0.1:9001")
    sent: dict[str, str] = {}
    r.inject(sent)
    r.first_byte()
    r.finish(200, True, (12, 34))
    s = spans_by_name(exporter)
    root, adm, choice, up = (s["POST /v1/chat/completions"], s["llmgw.admission"], s["llmgw.endpoint_choice"],
                             s["llmgw.upstream_attempt"])
    assert {x.context.trace_id for x in s.values()} == {int(TRACE, 16)}
    assert root.kind == SpanKind.SERVER and hex_span(root.parent) == PARENT and root.parent.is_remote
    assert adm.parent.span_id == root.context.span_id
    assert choice.parent.span_id == adm.context.span_id
    assert up.kind == SpanKind.CLIENT and up.parent.span_id == root.context.span_id
    assert sent == {"traceparent": f"00-{TRACE}-{hex_span(up.context)}-01", "tracestate": "congo=t61rcWkgMzE"}
    assert dict(root.attributes) == {
        "http.request.method": "POST", "http.route": "/v1/chat/completions", "llmgw.request_id": "rid-1",
        "gen_ai.request.model": "smollm2", "llmgw.priority": "standard", "llmgw.key.name": "alice",
        "http.response.status_code": 200, "llmgw.completed": True,
        "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 34,
    }
    assert choice.attributes["llmgw.endpoint"] == "ep-1"
    assert choice.attributes["llmgw.route.reason"] == "least expected completion"
    assert adm.attributes["llmgw.admission.decision"] == "send"
    assert up.attributes["llmgw.endpoint"] == "ep-1" and up.attributes["llmgw.outcome"] == "answer"
    assert [e.name for e in up.events] == ["first_byte"] and [e.name for e in root.events] == ["first_byte"]
    assert root.status.status_code == StatusCode.UNSET
    everything = repr([dict(x.attributes) for x in s.values()])
    assert "sk-secret" not in everything  # the key's name, never the key


@pytest.mark.parametrize("env", [{}, {"HTTP_TRACEPARENT": f"00-{'0' * 32}-{PARENT}-01", "HTTP_TRACESTATE": "congo=1"}])
def test_without_a_valid_client_context_a_request_starts_a_trace_and_drops_the_tracestate(traced, env):
    t, exporter = traced
    r = t.request(env, "rid", *CHAT)
    r.attempt(0, "ep-1", "http://e")
    sent: dict[str, str] = {}
    r.inject(sent)
    r.finish(200, True, None)
    root = spans_by_name(exporter)["POST /v1/chat/completions"]
    assert root.parent is None
    assert set(sent) == {"traceparent"}
    assert parse_traceparent(sent["traceparent"]).trace_id == f"{root.context.trace_id:032x}"


def test_a_queued_request_that_is_retried_shows_its_wait_and_both_attempts(traced):
    t, exporter = traced
    r = t.request({"HTTP_TRACEPARENT": TP}, "rid", *CHAT)
    r.admitting(3)
    r.queued(4)
    r.dequeued("admitted")
    r.choice("ep-1", "head of the queue", True)
    r.admitted("wait")
    r.attempt(0, "ep-1", "http://a")
    first: dict[str, str] = {}
    r.inject(first)
    r.attempt_failed("connect_error", None, True)
    r.admitting(0)
    r.choice("ep-2", "least loaded", False)
    r.admitted("send")
    r.attempt(1, "ep-2", "http://b")
    second: dict[str, str] = {}
    r.inject(second)
    r.finish(200, False, None)  # the client left mid-stream
    spans = exporter.get_finished_spans()
    attempts = sorted((s for s in spans if s.name == "llmgw.upstream_attempt"), key=lambda s: s.attributes["llmgw.attempt"])
    admissions = [s for s in spans if s.name == "llmgw.admission"]
    wait = next(s for s in spans if s.name == "llmgw.queue_wait")
    root = next(s for s in spans if s.name.startswith("POST"))
    assert len(admissions) == 2 and len(attempts) == 2
    assert wait.parent.span_id == admissions[0].context.span_id
    assert wait.attributes["llmgw.queue.position"] == 4 and wait.attributes["llmgw.queue.outcome"] == "admitted"
    assert attempts[0].attributes["llmgw.retried"] is True
    assert attempts[0].attributes["llmgw.outcome"] == "connect_error"
    assert attempts[0].status.status_code == StatusCode.ERROR
    assert attempts[1].attributes["llmgw.outcome"] == "cut"
    assert first["traceparent"] != second["traceparent"]  # each attempt is the engine's own parent
    assert second["traceparent"].split("-")[2] == hex_span(attempts[1].context)
    assert root.attributes["llmgw.completed"] is False and root.status.status_code == StatusCode.ERROR


def test_a_refused_request_ends_its_trace_once_with_the_error(traced):
    t, exporter = traced
    r = t.request({}, "rid", *CHAT)
    r.admitting(9)
    r.queued(10)
    r.refused(429, "shed", "model 'm' is saturated")
    r.finish(200, True, None)  # after the end: nothing
    r.attempt(0, "ep", "http://e")
    spans = spans_by_name(exporter)
    assert set(spans) == {"POST /v1/chat/completions", "llmgw.admission", "llmgw.queue_wait"}
    root = spans["POST /v1/chat/completions"]
    assert root.attributes["error.type"] == "shed" and root.attributes["http.response.status_code"] == 429
    assert root.status.status_code == StatusCode.UNSET  # a 4xx is the client's, not the server's error
    r2 = t.request({}, "rid2", *CHAT)
    r2.refused(503, "no_replica", "no Ready endpoint")
    failed = [s for s in exporter.get_finished_spans() if s.attributes.get("llmgw.request_id") == "rid2"][0]
    assert failed.status.status_code == StatusCode.ERROR and failed.status.description == "no Ready endpoint"


# --- the off path --------------------------------------------------------------------------------
def test_off_every_call_answers_with_a_shared_no_op(traced):
    _t, exporter = traced
    r = OFF.request({}, "rid", *CHAT)
    assert r is NOOP_REQUEST and not r.on
    for call in (lambda: r.identify("m", "k", "standard"), lambda: r.admitting(1), lambda: r.queued(1),
                 lambda: r.dequeued("admitted"), lambda: r.choice("e", "why", False), lambda: r.admitted("send"),
                 lambda: r.attempt(0, "e", "u"), lambda: r.attempt_failed("timeout", None, True), r.first_byte,
                 lambda: r.finish(200, True, (1, 2)), lambda: r.refused(500, "internal", "x")):
        assert call() is None
    headers = {"x-request-id": "rid"}
    r.inject(headers)
    assert headers == {"x-request-id": "rid"}
    assert OFF.start("llmgw.publish") is NO_SPAN and OFF.record("x", 0, 1) is NO_SPAN
    with OFF.span("llmgw.reconcile", attributes={"a": 1}) as s:
        assert s is NO_SPAN and s.traceparent is None and s.carrier() == {} and s.environment() == {}
        s.set("k", 1), s.event("e"), s.fail("no"), s.end()
    assert OFF.request({"HTTP_TRACEPARENT": "garbage"}, "rid", *CHAT) is NOOP_REQUEST
    assert exporter.get_finished_spans() == ()


def test_off_a_clients_trace_context_is_passed_to_the_engine_as_received():
    r = OFF.request({"HTTP_TRACEPARENT": TP, "HTTP_TRACESTATE": "congo=t61rcWkgMzE"}, "rid", *CHAT)
    assert isinstance(r, PassThrough)
    r.attempt(0, "ep", "http://e")
    headers = {"x-request-id": "rid"}
    r.inject(headers)
    assert headers == {"x-request-id": "rid", "traceparent": TP, "tracestate": "congo=t61rcWkgMzE"}


def test_a_process_that_never_configured_tracing_is_off():
    code = "from llmgw import tracing; print(tracing.active() is tracing.OFF)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True", out.stderr


def test_configure_sets_up_the_process_once(collector):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}", "PATH": "/usr/bin:/bin"}
    code = ("from llmgw import tracing; from opentelemetry import trace\n"
            "a = tracing.configure('one'); b = tracing.configure('two')\n"
            "print(a is b, a is tracing.active(), a.service, trace.get_tracer_provider() is a.provider)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, env=env)
    assert out.stdout.split() == ["True", "True", "one", "True"], out.stderr


# --- spans of the control plane, and contexts across processes ---------------------------------
def test_nested_spans_are_children_and_an_exception_fails_the_span(traced):
    t, exporter = traced
    with pytest.raises(ValueError):
        with t.span("llmgw.reconcile") as outer:
            with t.span("llmgw.create_replica", attributes={"llmgw.replica": "r1"}) as inner:
                inner.set("llmgw.node", "n1")
            raise ValueError("bad catalog")
    s = spans_by_name(exporter)
    assert s["llmgw.create_replica"].parent.span_id == s["llmgw.reconcile"].context.span_id
    assert dict(s["llmgw.create_replica"].attributes) == {"llmgw.replica": "r1", "llmgw.node": "n1"}
    failed = s["llmgw.reconcile"]
    assert failed.status.status_code == StatusCode.ERROR and "bad catalog" in failed.status.description
    assert failed.attributes["error.type"] == "ValueError"
    assert outer.traceparent.split("-")[2] == hex_span(failed.context)


def test_a_context_carried_in_a_record_or_task_headers_rebuilds_the_parent(traced):
    """The reconcile that creates a replica -> the launch on its node -> the engine's start: one trace."""
    from celery.app.task import Context

    t, exporter = traced
    with t.span("llmgw.catalog_apply") as apply_span:
        with t.span("llmgw.create_replica") as create:
            record = {"id": "r1", **create.carrier()}  # stored with the replica record
            task_headers = create.carrier()  # or sent as send_task(..., headers=...)
    request = Context({"id": "task-1", "task": "llmgw.launch", **task_headers})  # as a worker builds task.request
    assert from_task(request) == task_headers
    launch = t.start("llmgw.launch", parent=record, kind="consumer", attributes={"llmgw.node": "n1"})
    engine_env = launch.environment()
    launch.end()
    started = t.record("llmgw.engine_start", 1000.0, 1003.5, parent=carried(engine_env)[0])
    assert started.traceparent
    s = spans_by_name(exporter)
    assert len({x.context.trace_id for x in s.values()}) == 1
    assert s["llmgw.launch"].parent.span_id == s["llmgw.create_replica"].context.span_id
    assert s["llmgw.launch"].parent.is_remote and s["llmgw.launch"].kind == SpanKind.CONSUMER
    assert s["llmgw.engine_start"].parent.span_id == s["llmgw.launch"].context.span_id
    assert (s["llmgw.engine_start"].start_time, s["llmgw.engine_start"].end_time) == (1000 * 10**9, 1003_500_000_000)
    assert s["llmgw.create_replica"].parent.span_id == apply_span.otel.get_span_context().span_id
    assert set(engine_env) == {"TRACEPARENT"}


def test_links_name_causes_that_are_not_the_parent(traced):
    t, exporter = traced
    kick = t.start("llmgw.kick")
    kick.end()
    with t.span("llmgw.reconcile", parent=None, links=[kick.carrier(), None, "garbage"]):
        pass
    s = spans_by_name(exporter)
    [link] = s["llmgw.reconcile"].links
    assert link.context.span_id == s["llmgw.kick"].context.span_id
    assert s["llmgw.reconcile"].parent is None


def test_a_missing_or_invalid_carrier_leaves_the_current_span_as_parent(traced):
    t, exporter = traced
    with t.span("llmgw.agent_pass"):
        t.start("llmgw.launch", parent={"id": "r-old"}).end()  # a record made before it carried a trace
        t.start("llmgw.stop", parent={"traceparent": "nonsense"}).end()
    s = spans_by_name(exporter)
    assert s["llmgw.launch"].parent.span_id == s["llmgw.agent_pass"].context.span_id
    assert s["llmgw.stop"].parent.span_id == s["llmgw.agent_pass"].context.span_id


# --- greenlets and threads -----------------------------------------------------------------------
def test_the_current_span_does_not_leak_between_greenlets(traced):
    """gevent gives each greenlet its own contextvars: two interleaved passes each see only theirs."""
    import gevent
    import gevent.event
    from opentelemetry import trace

    t, exporter = traced
    a_in, b_in = gevent.event.Event(), gevent.event.Event()
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def name() -> str:
        return getattr(trace.get_current_span(), "name", "")

    def work(me: str, mine: gevent.event.Event, other: gevent.event.Event) -> None:
        with t.span(f"span-{me}"):
            mine.set()
            other.wait(5)  # the other greenlet has entered its own span meanwhile
            seen[me].append(name())
            with t.span(f"child-{me}"):
                gevent.sleep(0)
                seen[me].append(name())
        seen[me].append(name())

    ga = gevent.spawn(work, "a", a_in, b_in)
    gb = gevent.spawn(work, "b", b_in, a_in)
    gevent.joinall([ga, gb], timeout=10, raise_error=True)
    assert seen == {"a": ["span-a", "child-a", ""], "b": ["span-b", "child-b", ""]}
    s = spans_by_name(exporter)
    assert s["child-a"].parent.span_id == s["span-a"].context.span_id
    assert s["child-b"].parent.span_id == s["span-b"].context.span_id
    assert s["span-a"].context.trace_id != s["span-b"].context.trace_id
    assert name() == ""  # the test's own greenlet saw none of it


def test_the_current_span_does_not_leak_between_threads(traced):
    from opentelemetry import trace

    t, _exporter = traced
    inside, release = threading.Event(), threading.Event()
    seen = []

    def work():
        with t.span("thread-pass"):
            inside.set()
            release.wait(5)

    th = threading.Thread(target=work)
    th.start()
    assert inside.wait(5)
    seen.append(trace.get_current_span().get_span_context().is_valid)
    release.set()
    th.join(5)
    assert seen == [False]


def test_a_short_lived_command_waits_out_a_collector_that_is_down_for_its_export_timeout_only():
    """A dead collector costs a process that exports at exit the exporter's retries: ~7 s with the
    default 10 s timeout (1 + 2 + 4 s of backoff), at most `export_timeout` with one (the CLI's)."""
    import os
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    code = ("from llmgw import tracing\n"
            "t = tracing.configure('llmgw', export_timeout=1.0)\n"
            "with t.span('llmgw.catalog_apply'): pass\n"
            "print(t is not tracing.OFF)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{dead}"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    took = time.monotonic() - t0
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr
    assert "Failed to export" in out.stderr  # it tried, and said so
    assert took < 5.0, f"exiting took {took:.1f}s"
