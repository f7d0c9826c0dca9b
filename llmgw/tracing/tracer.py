"""The two faces of tracing a process holds: `Tracing` records spans through an OpenTelemetry
TracerProvider; `Off` takes the same calls and does nothing, building nothing."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping

from llmgw.tracing import w3c
from llmgw.tracing.request import NoRequestTrace, RequestTrace, off_request
from llmgw.tracing.spans import NO_SPAN, NoSpan, Parent, Span, context_of, ns

KINDS = ("internal", "server", "client", "producer", "consumer")
_NO_SPAN_BLOCK = contextlib.nullcontext(NO_SPAN)  # reusable: `with off.span(...) as s` costs nothing


class Tracing:
    """Spans recorded through one TracerProvider (`llmgw.tracing.configure` makes the process's; a
    test passes one with an in-memory exporter)."""

    on = True

    def __init__(self, provider, service: str = "llmgw"):
        from opentelemetry.trace import SpanKind

        self.provider = provider
        self.service = service
        self.tracer = provider.get_tracer("llmgw")
        self.kinds = {name: getattr(SpanKind, name.upper()) for name in KINDS}

    def request(self, environ: Mapping[str, Any], rid: str, method: str, route: str) -> RequestTrace:
        """The trace of one proxied request (WSGI `environ`), child of the client's `traceparent`
        when it sent a valid one, else the start of a new trace."""
        parent = w3c.parse_traceparent(environ.get("HTTP_TRACEPARENT"))
        state = w3c.clean_tracestate(environ.get("HTTP_TRACESTATE")) if parent is not None else None
        return RequestTrace(self.tracer, self.kinds, f"{method} {route}", rid, parent, state, method, route)

    def start(self, name: str, parent: Parent = None, attributes: Mapping[str, Any] | None = None,
              kind: str = "internal", links: Iterable[Parent] = (), at: float | None = None) -> Span:
        """A span to end explicitly (`Span.end`), child of `parent` (None: the current span), linked
        to `links` (causes that are not its parent: the passes whose kicks led to it)."""
        return Span(self.tracer.start_span(
            name, context=context_of(parent), kind=self.kinds[kind], attributes=attributes,
            links=self._links(links), start_time=ns(at) if at is not None else None))

    @contextlib.contextmanager
    def span(self, name: str, parent: Parent = None, attributes: Mapping[str, Any] | None = None,
             kind: str = "internal", links: Iterable[Parent] = ()) -> Iterator[Span]:
        """`with tracing.span("llmgw.reconcile") as s:` a span current for the block (a span started
        in it without a parent is its child), failed by an exception that leaves the block."""
        from opentelemetry import context, trace

        s = self.start(name, parent, attributes, kind, links)
        token = context.attach(trace.set_span_in_context(s.otel))
        try:
            yield s
        except BaseException as e:
            s.otel.record_exception(e)
            s.fail(f"{type(e).__name__}: {e}", type(e).__name__)
            raise
        finally:
            context.detach(token)
            s.end()

    def record(self, name: str, start: float, end: float, parent: Parent = None,
               attributes: Mapping[str, Any] | None = None, error: str | None = None) -> Span:
        """A span for work already done, from its recorded times (epoch seconds): an engine's start
        from its spawn to its first good health probe, seen by a level-based loop after the fact."""
        s = self.start(name, parent, attributes, at=start)
        if error:
            s.fail(error)
        s.end(at=end)
        return s

    def _links(self, parents: Iterable[Parent]) -> list:
        out = []
        for p in parents:
            ctx = context_of(p)
            if ctx is not None:
                from opentelemetry import trace
                from opentelemetry.trace import Link

                out.append(Link(trace.get_current_span(ctx).get_span_context()))
        return out

    def shutdown(self) -> None:
        """Export what is buffered and stop (the provider also does this at exit)."""
        self.provider.shutdown()


class Off:
    """Tracing while it is off (the default): every call returns a no-op at once."""

    on = False
    service = ""

    def request(self, environ: Mapping[str, Any], rid: str, method: str, route: str) -> NoRequestTrace:
        return off_request(environ)

    def start(self, name: str, parent: Parent = None, attributes: Mapping[str, Any] | None = None,
              kind: str = "internal", links: Iterable[Parent] = (), at: float | None = None) -> NoSpan:
        return NO_SPAN

    def span(self, name: str, parent: Parent = None, attributes: Mapping[str, Any] | None = None,
             kind: str = "internal", links: Iterable[Parent] = ()):
        return _NO_SPAN_BLOCK

    def record(self, name: str, start: float, end: float, parent: Parent = None,
               attributes: Mapping[str, Any] | None = None, error: str | None = None) -> NoSpan:
        return NO_SPAN

    def shutdown(self) -> None:
        pass


OFF = Off()
