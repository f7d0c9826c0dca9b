"""Tracing: OpenTelemetry spans exported over OTLP when the standard environment asks for it, and
W3C trace context taken from clients and passed on to engines (docs/tracing.md).

Off by default, and then free: `OFF` and its no-op objects answer every call without building a
span, a context or an attribute dict, and OpenTelemetry is never imported.

    tracing = configure("llmgw-gateway")        # once per process: Tracing, or OFF
    trace = tracing.request(environ, rid, "POST", "/v1/chat/completions")   # the gateway's request
    with tracing.span("llmgw.reconcile") as s:  # a control pass; s.carrier() crosses processes
        ...
    tracing.record("llmgw.engine_start", spawned_at, ready_at, parent=record_carrier)
"""

from llmgw.tracing.request import NOOP_REQUEST, NoRequestTrace, PassThrough, RequestTrace
from llmgw.tracing.setup import Plan, active, build, configure, plan
from llmgw.tracing.spans import NO_SPAN, NoSpan, Span, carried, from_task, otel_context
from llmgw.tracing.tracer import OFF, Off, Tracing
from llmgw.tracing.w3c import TraceParent, clean_tracestate, format_traceparent, forwardable, parse_traceparent

__all__ = [
    "NOOP_REQUEST", "NO_SPAN", "OFF", "NoRequestTrace", "NoSpan", "Off", "PassThrough", "Plan", "RequestTrace",
    "Span", "TraceParent", "Tracing", "active", "build", "carried", "clean_tracestate", "configure",
    "format_traceparent", "forwardable", "from_task", "otel_context", "parse_traceparent", "plan",
]
