"""The span handle the callers hold (`Span`, or `NoSpan` while tracing is off), and the carriers a
trace context crosses processes in.

A carrier is a dict holding `traceparent` (and `tracestate`): stored in a replica record, sent as
Celery task headers (Celery puts a message's custom headers on `task.request` as attributes:
`from_task`), or given to an engine as TRACEPARENT/TRACESTATE in its environment (the OpenTelemetry
convention for environment carriers).
"""

from __future__ import annotations

from typing import Any, Mapping

from llmgw.tracing import w3c

Parent = Any  # a Span, a traceparent string, a carrier mapping, or None (the current context)


def ns(t: float) -> int:
    """Epoch seconds as the nanoseconds OpenTelemetry takes."""
    return int(t * 1e9)


class Span:
    """One recording span, as the code that made it needs it."""

    __slots__ = ("otel",)
    on = True

    def __init__(self, otel):
        self.otel = otel

    def set(self, key: str, value) -> None:
        if value is not None:
            self.otel.set_attribute(key, value)

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self.otel.add_event(name, attributes)

    def fail(self, message: str, kind: str | None = None) -> None:
        """Mark the span failed (its status, and `error.type` when given)."""
        from opentelemetry.trace import Status, StatusCode

        self.otel.set_status(Status(StatusCode.ERROR, message))
        if kind:
            self.otel.set_attribute("error.type", kind)

    def end(self, at: float | None = None) -> None:
        self.otel.end(end_time=ns(at) if at is not None else None)

    @property
    def traceparent(self) -> str:
        sc = self.otel.get_span_context()
        return w3c.format_traceparent(sc.trace_id, sc.span_id, sc.trace_flags.sampled)

    def carrier(self) -> dict[str, str]:
        """This span as a child's parent in another process: a record field, task headers."""
        out = {"traceparent": self.traceparent}
        state = self.otel.get_span_context().trace_state.to_header()
        if state:
            out["tracestate"] = state
        return out

    def environment(self) -> dict[str, str]:
        """The carrier as a child process's environment (TRACEPARENT, TRACESTATE)."""
        return {k.upper(): v for k, v in self.carrier().items()}


class NoSpan:
    """What every call returns while tracing is off: every method does nothing."""

    __slots__ = ()
    on = False
    traceparent = None

    def set(self, key: str, value) -> None:
        pass

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def fail(self, message: str, kind: str | None = None) -> None:
        pass

    def end(self, at: float | None = None) -> None:
        pass

    def carrier(self) -> dict[str, str]:
        return {}

    def environment(self) -> dict[str, str]:
        return {}


NO_SPAN = NoSpan()


def carried(carrier: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """(traceparent, tracestate) from a carrier: a dict, a record's fields, or an environment
    (TRACEPARENT in capitals)."""
    if not carrier:
        return None, None
    tp = carrier.get("traceparent") or carrier.get("TRACEPARENT")
    ts = carrier.get("tracestate") or carrier.get("TRACESTATE")
    return (tp if isinstance(tp, str) else None), (ts if isinstance(ts, str) else None)


def from_task(request) -> dict[str, str]:
    """The carrier a Celery task was sent with (`send_task(..., headers=span.carrier())`): Celery
    copies the message's custom headers onto `task.request` as attributes."""
    out = {}
    for name in ("traceparent", "tracestate"):
        value = getattr(request, name, None)
        if isinstance(value, str):
            out[name] = value
    return out


def otel_context(traceparent: str | None, tracestate: str | None = None):
    """An OpenTelemetry Context whose current span is the remote parent these headers name; None
    when the traceparent is absent or invalid (its tracestate is then dropped, as the spec says)."""
    tp = w3c.parse_traceparent(traceparent)
    return None if tp is None else remote_context(tp, w3c.clean_tracestate(tracestate))


def remote_context(tp: w3c.TraceParent, tracestate: str | None):
    """The Context of a parsed remote parent (`tracestate` already cleaned)."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    sc = SpanContext(int(tp.trace_id, 16), int(tp.span_id, 16), is_remote=True,
                     trace_flags=TraceFlags(tp.flags & w3c.SAMPLED),
                     trace_state=TraceState.from_header([tracestate]) if tracestate else TraceState())
    return trace.set_span_in_context(NonRecordingSpan(sc))


def context_of(parent: Parent):
    """The OpenTelemetry Context to start a child in; None means the current one."""
    if parent is None or isinstance(parent, NoSpan):
        return None
    from opentelemetry import trace

    if isinstance(parent, Span):
        return trace.set_span_in_context(parent.otel)
    if isinstance(parent, str):
        return otel_context(parent)
    return otel_context(*carried(parent))
