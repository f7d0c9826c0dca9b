"""The client's answer to a proxied request: the engine's answer passed on (a whole body, or a stream
relayed as it arrives), or an error body; and what an answer counts when it ends (metrics, the
console's traffic, usage, and the sample the router learns from).
"""

from __future__ import annotations

import json
import logging

from flask import Response
from werkzeug.http import HTTP_STATUS_CODES

from gateway.errors import ApiError, engine_error, error_body
from gateway.http.attempt import Proxied, Hop
from gateway.http.evictions import Evictions
from gateway.http.resume import Pause, ResumingBody
from gateway.http.tally import Tally
from gateway.keys.usage import UsageRecorder
from gateway.observe.metrics import Metrics
from gateway.observe.resumes import ResumeSignals
from gateway.observe.traffic import TrafficCounter
from gateway.request.client import ClientConn
from gateway.routing.choice import Choice
from gateway.routing.router import Lease
from gateway.upstream.assemble import Assembler
from gateway.upstream.client import STREAM_REPLACED, UpstreamResponse, response_headers
from gateway.upstream.rewrite import AnswerRewrite
from gateway.upstream.resume import STREAMED_OPS, ask_again
from gateway.upstream.stream import StreamBody, usage_from_json
from llmgw import surface as op
from llmgw.state.clock import Clock

log = logging.getLogger("llmgw.gateway")

# Proxies in front (nginx) must not buffer a stream, nor anything cache it.
SSE_HEADERS = [("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")]
# A stream answered as one JSON body: the stream's headers and its type are not the answer's.
STREAMED_AS_JSON = STREAM_REPLACED | {"content-type"}


def error_response(err: ApiError, request_id: str | None = None) -> Response:
    resp = Response(json.dumps(error_body(err.kind, err.message, err.param)), status=err.status,
                    mimetype="application/json")
    if err.retry_after is not None:
        resp.headers["Retry-After"] = str(int(err.retry_after))
    if request_id:
        resp.headers["X-Request-Id"] = request_id
    return resp


class RawAnswer:
    """A proxied answer as a bare WSGI app: status, headers and body iterable as they are (werkzeug's
    Response cost ~0.05 ms per request here and added nothing). A stream's body is the StreamBody,
    whose `close()` the server calls."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list[tuple[str, str]], body):
        self.status, self.headers, self.body = status, headers, body

    def start(self, start_response) -> None:
        try:
            start_response(f"{self.status} {HTTP_STATUS_CODES.get(self.status, 'UNKNOWN')}", self.headers)
        except BaseException:
            # The server refused the head (an engine's malformed header, say): it will never close the
            # body, so give back what the body holds (the upstream connection, the slot) here.
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
            raise

    def __call__(self, environ, start_response):
        self.start(start_response)
        return self.body


def prefix_note(c: Choice, metrics: Metrics) -> str:
    """The prefix-cache routing of a request, for its answer's header, and counted in the metrics."""
    ep = c.endpoint.id
    metrics.child(metrics.prefix_prompt, ep).inc(c.prompt)
    if c.matched:
        metrics.child(metrics.prefix_predicted, ep).inc(c.matched)
        metrics.child(metrics.prefix_saved, ep).inc(c.saved)
    return (f"matched={int(c.matched)}/{int(c.prompt)} tokens; endpoint_hit={c.matched / c.prompt:.2f}; "
            f"saved_ms={c.saved * 1000:.1f}; via={'kv_events' if c.kv_events else 'sent'}; "
            # why it went there: the cost it was expected at, what the endpoint held before it (requests,
            # and seconds of prefill sent and not yet done), how long it waited in the gateway's queue
            # first, and the rule that picked it
            f"expected_ms={c.score * 1000:.0f}; ahead={c.ahead}; backlog_ms={c.behind * 1000:.0f}; "
            f'held_ms={c.waited * 1000:.0f}; rule="{c.reason}"'
            + (f"; runner_up={c.runner_up[0]}; runner_up_ms={c.runner_up[1] * 1000:.0f}; "
               f"runner_up_matched={int(c.runner_up[2])}" if c.runner_up else ""))


class OpenRequests:
    """Requests being proxied (parsed, queued, or streaming) in this process, and the most it takes
    before answering 503: each holds a client connection, and once routed an upstream one. The
    gevent worker switches greenlets only on I/O, so the plain += / -= on `n` are atomic."""

    __slots__ = ("n", "cap")

    def __init__(self, cap: int):
        self.n, self.cap = 0, cap


class Answers:
    """Builds answers and counts them when they end."""

    def __init__(self, clock: Clock, metrics: Metrics, traffic: TrafficCounter, usage: UsageRecorder,
                 total_timeout: float, open_requests: OpenRequests, stall_timeout: float = 0.0,
                 resumes: ResumeSignals | None = None, evictions: Evictions | None = None,
                 pause: Pause | None = None):
        self.clock, self.metrics, self.traffic, self.usage = clock, metrics, traffic, usage
        self.total_timeout, self.open = total_timeout, open_requests
        self.stall_timeout = stall_timeout  # seconds without a piece after the first: a stalled engine
        self.resumes = resumes if resumes is not None else ResumeSignals()
        # The answers that may be evicted (gateway.http.evictions; None or disabled: none may).
        self.evictions = evictions if evictions is not None and evictions.enabled else None
        self.pause = pause if pause is not None else Pause(clock=clock.monotonic, metrics=metrics)

    def respond(self, ex: Proxied, hop: Hop) -> RawAnswer:
        """The client's answer to request `ex`, from the endpoint of `hop`. On return the answer owns
        `hop` (a stream gives it back when it ends or the client leaves); if this raises, the caller
        still owns it. An answer the engine streams to a client that did not ask for a stream is read
        into one JSON answer while the client is watched (gateway.upstream.assemble). An engine that
        breaks off is not the answer's end: a stream resumes on another endpoint (gateway.http.resume),
        a whole answer is asked for again there (`gateway.upstream.resume.ask_again`)."""
        sse = hop.resp.content_type.startswith("text/event-stream")
        if sse and hop.ask.assemble is None:
            return self._stream(ex, hop)
        return self._whole(ex, hop, sse and hop.ask.assemble is not None)

    def _tally(self, ex: Proxied, hop: Hop) -> Tally:
        return Tally(self.clock, self.metrics, self.traffic, self.usage, self.open, ex, hop)

    def _stream(self, ex: Proxied, hop: Hop) -> RawAnswer:
        tally, call, status = self._tally(ex, hop), ex.call, hop.resp.status
        headers = self._headers(hop.resp, hop.lease, ex.rid, False, True) + SSE_HEADERS
        deadline = ex.t0 + self.total_timeout
        if status < 400 and call.route.op in STREAMED_OPS and call.body is not None:
            body = ResumingBody(hop, ex, self.stall_timeout, deadline, tally.first, tally.stream_end,
                                self.clock.monotonic, self._on_hop(ex), call.model, self.evictions, self.pause)
        else:
            body = StreamBody(hop.resp, deadline, tally.first, tally.stream_end, monotonic=self.clock.monotonic,
                              rewrite=AnswerRewrite(call.model, hop.ask.rewrite) if status < 400 else None)
        return RawAnswer(status, headers, body)

    def _whole(self, ex: Proxied, hop: Hop, assembling: bool) -> RawAnswer:
        """A whole answer: read, asked for again on another endpoint if its engine breaks off before
        it is read whole (nothing reached the client yet), then passed on."""
        tally, model, hops = self._tally(ex, hop), ex.call.model, 0
        ex.trace.first_byte()  # the head arrived (a whole answer's first byte); the body follows
        while True:
            try:
                status, payload = self._read(hop, assembling, ex.call.route.op == op.CHAT)
                break
            except Exception as e:  # noqa: BLE001 - asked for again elsewhere, or a clean 502/504 below
                hop.resp.close()
                gone = assembling and hop.ask.assemble.gone()
                new, failed = self._again(ex, hop, e, hops, gone)
                if new is None:
                    tally.end(hop.lease, hop.resp.status, False, None, charted=False)
                    if gone:
                        self.metrics.child(self.metrics.client_gone, model, "answering").inc()
                        raise ApiError("client_gone", f"the client left while endpoint {hop.choice.endpoint.id} "
                                                      "answered") from None
                    raise failed from None
                hop.lease.release()
                hop, hops = new, hops + 1
                assembling = hop.ask.assemble is not None and hop.resp.content_type.startswith("text/event-stream")
        hop.resp.release()
        headers = self._headers(hop.resp, hop.lease, ex.rid, assembling, False)
        if status >= 400:  # the engine's error in the gateway's shape (a 2xx answer never comes here)
            status, payload = engine_error(status, payload, hop.choice.endpoint.id)
            headers = [h for h in headers if h[0].lower() != "content-type"]
            headers.append(("Content-Type", "application/json"))
        elif hop.ask.rewrite is not None or assembling or hop.resp.content_type.startswith("application/json"):
            payload = AnswerRewrite(model, hop.ask.rewrite).body(payload)
        tally.whole(hop.lease, status, usage_from_json(payload) if status < 400 else None)
        headers.append(("Content-Length", str(len(payload))))
        return RawAnswer(status, headers, [payload])

    def _read(self, hop: Hop, assembling: bool, chat: bool) -> tuple[int, bytes]:
        if assembling:
            return self._assemble(hop.resp, hop.ask.assemble, chat)
        return hop.resp.status, hop.resp.read()

    def _again(self, ex: Proxied, hop: Hop, e: Exception, hops: int, gone: bool) -> tuple[Hop | None, ApiError]:
        """A whole answer's engine failed while it was read: the new Hop that answers it instead, or
        None and the error the request ends with."""
        ep, status = hop.choice.endpoint.id, hop.resp.status
        again = ask_again(status, hops, ex.sender.cfg.resumes, ex.resume_off(), gone)
        ex.trace.attempt_failed("broken", status, again)
        kind = "upstream_timeout" if "timed out" in str(e).lower() else "upstream_error"
        failed = ApiError(kind, f"endpoint {ep} failed while answering: {type(e).__name__}")
        if not again:
            return None, failed
        try:
            new = ex.send(exclude=frozenset({ep}))
        except ApiError as why:
            return None, ApiError(kind, f"endpoint {ep} failed while answering ({type(e).__name__}) and no other "
                                        f"took it: {why.message}")
        self._on_hop(ex)("reset", ep, "retried", new.choice.endpoint.id, 0)
        log.warning("request %s: endpoint %s failed while answering (%s); asked %s again", ex.rid, ep,
                    type(e).__name__, new.choice.endpoint.id)
        return new, failed

    def _on_hop(self, ex: Proxied):
        """What a break of an answer's engine is told to: the counter by model, cause and outcome, and
        the signals the event history is written from."""
        metrics, signals, model, canon = self.metrics, self.resumes, ex.call.model, ex.plan.canon

        def on_hop(cause: str, old: str, outcome: str, new: str | None, tokens: int) -> None:
            metrics.child(metrics.stream_resumes, model, cause, outcome).inc()
            metrics.child(metrics.upstream_errors, old, "broken").inc()
            signals.hop(canon, cause, outcome)

        return on_hop

    def _headers(self, resp: UpstreamResponse, lease: Lease, rid: str, assembling: bool,
                 streamed: bool) -> list[tuple[str, str]]:
        """One pass over the engine's headers; X-Request-Id is ours (an engine echoing it would
        otherwise send it twice), and a stream's caching headers are ours too."""
        headers = response_headers(resp, STREAMED_AS_JSON if assembling else STREAM_REPLACED if streamed else None)
        if assembling:
            headers.append(("Content-Type", "application/json"))
        headers += [("X-Request-Id", rid), ("X-LLMGW-Endpoint", lease.choice.endpoint.id)]
        if lease.choice.prompt:
            headers.append(("X-LLMGW-Prefix", prefix_note(lease.choice, self.metrics)))
        return headers

    @staticmethod
    def _assemble(resp: UpstreamResponse, client: ClientConn, chat: bool) -> tuple[int, bytes]:
        """The engine's stream read into one answer. The client is checked between pieces, and under
        gevent watched meanwhile: when it leaves, the engine's connection is shut at once (also in
        the middle of a long prefill, when no piece comes), so the read ends and the engine aborts."""
        asm = Assembler(chat)

        def left() -> None:  # from gevent's loop, when the client's socket turns readable
            if client.gone():
                resp.shutdown()

        unwatch = client.when_readable(left)
        try:
            for piece in resp.chunks():
                if client.gone():
                    raise ConnectionAbortedError("the client left")
                asm.feed(piece)
        finally:
            if unwatch is not None:
                unwatch()
        return asm.result()

