"""The trace of one proxied request, shaped like the gateway's request path.

    POST /v1/chat/completions            server span: model, key name, priority, status, tokens
      llmgw.admission                    one per routing try: the decision (send, wait, shed, reject)
        llmgw.queue_wait                 while it waits for an endpoint to free: position, outcome
        llmgw.endpoint_choice            the endpoint and the router's reason
      llmgw.upstream_attempt             client span per attempt: endpoint, outcome, status, retried;
                                         its id is the parent the engine sees (traceparent);
                                         events: first_byte

Methods take positional values only and the off-path objects (`NOOP_REQUEST`, `PassThrough`) do
nothing in them, so a request that is not traced builds no span, context or attribute dict. Every
method is safe to call in any order and after the end (an error path may end the trace early).
"""

from __future__ import annotations

from typing import MutableMapping

from llmgw.tracing import w3c
from llmgw.tracing.spans import Span, remote_context


class RequestTrace:
    """A traced request (tracing is on)."""

    __slots__ = ("tracer", "kinds", "root", "ctx", "admission", "queue", "upstream", "done", "waited")
    on = True

    def __init__(self, tracer, kinds, name: str, rid: str, parent: w3c.TraceParent | None,
                 tracestate: str | None, method: str, route: str):
        from opentelemetry import context, trace

        self.tracer, self.kinds = tracer, kinds
        ctx = remote_context(parent, tracestate) if parent is not None else context.Context()  # else a new trace
        self.root = tracer.start_span(name, context=ctx, kind=kinds["server"], attributes={
            "http.request.method": method, "http.route": route, "llmgw.request_id": rid})
        self.ctx = trace.set_span_in_context(self.root)
        self.admission = self.queue = self.upstream = None
        self.done = False
        self.waited = False  # this admission queued: a "send" after it is recorded as "wait"

    def _child(self, name: str, parent, attributes: dict, kind: str = "internal"):
        from opentelemetry import trace

        ctx = self.ctx if parent is None else trace.set_span_in_context(parent)
        return self.tracer.start_span(name, context=ctx, kind=self.kinds[kind], attributes=attributes)

    def identify(self, model: str, key_name: str | None, priority: str) -> None:
        """What the request asks for, once read: the model named, the key's name (never the key)."""
        r = self.root
        r.set_attribute("gen_ai.request.model", model)
        r.set_attribute("llmgw.priority", priority)
        if key_name:
            r.set_attribute("llmgw.key.name", key_name)

    # --- admission -------------------------------------------------------------------------------
    def admitting(self, queue_len: int) -> None:
        """A routing try starts (the first, or one after a failed attempt)."""
        if self.done:
            return
        self._end_admission()
        self.waited = False
        self.admission = self._child("llmgw.admission", None, {"llmgw.queue.length": queue_len})

    def queued(self, position: int) -> None:
        if self.done:
            return
        self._end_queue()
        self.waited = True
        self.queue = self._child("llmgw.queue_wait", self.admission, {"llmgw.queue.position": position})

    def dequeued(self, outcome: str) -> None:
        """The wait ended: "admitted", "timeout", "left" (the client went away), or a rejection kind."""
        if self.queue is not None:
            self.queue.set_attribute("llmgw.queue.outcome", outcome)
            self._end_queue()

    def choice(self, endpoint_id: str, reason: str, saturated: bool) -> None:
        """The router's pick, with its reason (an instant span under the admission)."""
        if self.done:
            return
        s = self._child("llmgw.endpoint_choice", self.admission, {
            "llmgw.endpoint": endpoint_id, "llmgw.route.reason": reason, "llmgw.route.saturated": saturated})
        s.end()

    def admitted(self, decision: str) -> None:
        """The admission's outcome: "send", or the refusal's kind ("shed", "no_replica", ...). A
        "send" after the request waited in a queue (`queued`) is recorded as "wait"."""
        if self.admission is not None:
            if decision == "send" and self.waited:
                decision = "wait"
            self.admission.set_attribute("llmgw.admission.decision", decision)
            self._end_admission()

    # --- upstream --------------------------------------------------------------------------------
    def attempt(self, n: int, endpoint_id: str, url: str) -> None:
        """Attempt `n` (0 first) goes to `endpoint_id`; `inject` then names it to the engine."""
        if self.done:
            return
        self._end_admission()
        self._end_upstream()
        self.upstream = self._child("llmgw.upstream_attempt", None, {
            "llmgw.attempt": n, "llmgw.endpoint": endpoint_id, "url.full": url}, kind="client")

    def attempt_failed(self, outcome: str, status: int | None, retried: bool) -> None:
        """The attempt got no answer worth passing on ("connect_error", "timeout", or "answer" with a
        status the retry policy refused); `retried`: another attempt follows."""
        up = self.upstream
        if up is None:
            return
        up.set_attribute("llmgw.outcome", outcome)
        up.set_attribute("llmgw.retried", retried)
        if status is not None:
            up.set_attribute("http.response.status_code", status)
        self._fail(up, outcome)
        self._end_upstream()

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """The engine's trace context: the current attempt's span as its parent."""
        span = self.upstream if self.upstream is not None else self.root
        headers.update(Span(span).carrier())

    def first_byte(self) -> None:
        if self.upstream is not None:
            self.upstream.add_event("first_byte")
        self.root.add_event("first_byte")

    # --- the end ---------------------------------------------------------------------------------
    def finish(self, status: int, completed: bool, usage: tuple[int, int] | None) -> None:
        """The answer ended: passed on whole (`completed`) or cut (the client left, the engine broke
        off, the total timeout), with the tokens the engine reported."""
        if self.done:
            return
        up = self.upstream
        if up is not None:
            up.set_attribute("llmgw.outcome", "answer" if completed else "cut")
            up.set_attribute("http.response.status_code", status)
            if status >= 400 or not completed:
                self._fail(up, str(status) if completed else "cut")
        r = self.root
        r.set_attribute("http.response.status_code", status)
        r.set_attribute("llmgw.completed", completed)
        if usage:
            r.set_attribute("gen_ai.usage.input_tokens", usage[0])
            r.set_attribute("gen_ai.usage.output_tokens", usage[1])
        if status >= 500 or not completed:
            self._fail(r, str(status) if completed else "cut")
        self._end_all()

    def targets(self, targets: str, missed: str, predicted: float | None) -> None:
        """The request had latency targets (`targets`, in words): what it `missed` ("" none) and the
        first token the router predicted from its send (seconds; None: not predicted)."""
        if self.done:
            return
        r = self.root
        r.set_attribute("llmgw.slo.targets", targets)
        r.set_attribute("llmgw.slo.met", not missed)
        if predicted is not None:
            r.set_attribute("llmgw.slo.predicted_ttft", predicted)

    def refused(self, status: int, kind: str, message: str) -> None:
        """The gateway answered with an error of its own (ApiError): its status, kind and message."""
        if self.done:
            return
        r = self.root
        r.set_attribute("http.response.status_code", status)
        r.set_attribute("llmgw.completed", False)
        r.set_attribute("error.type", kind)
        if status >= 500:
            self._fail(r, message)
        self._end_all()

    # --- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _fail(span, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, message))

    def _end_queue(self) -> None:
        if self.queue is not None:
            self.queue.end()
            self.queue = None

    def _end_admission(self) -> None:
        self._end_queue()
        if self.admission is not None:
            self.admission.end()
            self.admission = None

    def _end_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.end()
            self.upstream = None

    def _end_all(self) -> None:
        self._end_admission()
        self._end_upstream()
        self.root.end()
        self.done = True


class NoRequestTrace:
    """A request that is not traced: every method does nothing."""

    __slots__ = ()
    on = False

    def identify(self, model: str, key_name: str | None, priority: str) -> None:
        pass

    def admitting(self, queue_len: int) -> None:
        pass

    def queued(self, position: int) -> None:
        pass

    def dequeued(self, outcome: str) -> None:
        pass

    def choice(self, endpoint_id: str, reason: str, saturated: bool) -> None:
        pass

    def admitted(self, decision: str) -> None:
        pass

    def attempt(self, n: int, endpoint_id: str, url: str) -> None:
        pass

    def attempt_failed(self, outcome: str, status: int | None, retried: bool) -> None:
        pass

    def inject(self, headers: MutableMapping[str, str]) -> None:
        pass

    def first_byte(self) -> None:
        pass

    def finish(self, status: int, completed: bool, usage: tuple[int, int] | None) -> None:
        pass

    def targets(self, targets: str, missed: str, predicted: float | None) -> None:
        pass

    def refused(self, status: int, kind: str, message: str) -> None:
        pass


NOOP_REQUEST = NoRequestTrace()


class PassThrough(NoRequestTrace):
    """Tracing is off but the client sent a trace context: pass it to the engine as received, so an
    engine or backend that traces still joins the client's trace (the spec's forwarding mode)."""

    __slots__ = ("headers",)

    def __init__(self, traceparent: str, tracestate: str | None):
        self.headers = {"traceparent": traceparent}
        if tracestate:
            self.headers["tracestate"] = tracestate

    def inject(self, headers: MutableMapping[str, str]) -> None:
        headers.update(self.headers)


def off_request(environ) -> NoRequestTrace:
    """The request's trace while tracing is off: nothing, or the client's context to forward."""
    tp = environ.get("HTTP_TRACEPARENT")
    if tp is None:
        return NOOP_REQUEST
    fw = w3c.forwardable(tp, environ.get("HTTP_TRACESTATE"))
    return NOOP_REQUEST if fw is None else PassThrough(*fw)
