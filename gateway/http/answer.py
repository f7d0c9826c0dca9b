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
from gateway.http.resume import Hop, ResendFailed, Resender, Resumes, ResumingBody
from gateway.keys.table import ApiKey
from gateway.keys.usage import UsageRecorder
from gateway.observe.metrics import Metrics
from gateway.observe.resumes import ResumeSignals
from gateway.observe.traffic import TrafficCounter
from gateway.request.client import ClientConn
from gateway.request.surface import Route
from gateway.response_ids import IdRewrite
from gateway.routing.choice import Choice
from gateway.routing.router import Lease
from gateway.upstream.assemble import Assembler
from gateway.upstream.client import STREAM_REPLACED, UpstreamResponse, response_headers
from gateway.upstream.rewrite import AnswerRewrite
from gateway.upstream.resume import STREAMED_OPS
from gateway.upstream.stream import StreamBody, usage_from_json
from llmgw import surface as op
from llmgw.state.keypolicy import ANONYMOUS
from llmgw.state.clock import Clock
from llmgw.tracing import NOOP_REQUEST

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
            f'held_ms={c.waited * 1000:.0f}; rule="{c.reason}"')


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
                 resumes: ResumeSignals | None = None):
        self.clock, self.metrics, self.traffic, self.usage = clock, metrics, traffic, usage
        self.total_timeout, self.open = total_timeout, open_requests
        self.stall_timeout = stall_timeout  # seconds without a piece after the first: a stalled engine
        self.resumes = resumes if resumes is not None else ResumeSignals()

    def _on_hop(self, model: str, canon: str):
        """What a break of an answer's engine is told to (gateway.http.resume): the counter by model,
        cause and outcome, and the signals the event history is written from."""
        metrics, signals = self.metrics, self.resumes

        def on_hop(cause: str, old: str, outcome: str, new: str | None, tokens: int) -> None:
            metrics.child(metrics.stream_resumes, model, cause, outcome).inc()
            metrics.child(metrics.upstream_errors, old, "broken").inc()
            signals.hop(canon, cause, outcome)

        return on_hop

    def respond(self, resp: UpstreamResponse, lease: Lease, model: str, canon: str, key: ApiKey | None, rid: str,
                t0: float, t_send: float, route: Route, rewrite: IdRewrite | None = None,
                assemble: ClientConn | None = None, trace=NOOP_REQUEST, resend: Resender | None = None,
                charge=None) -> RawAnswer:
        """Build the client's answer. On return the answer owns `resp` and `lease` (a stream releases
        them when it ends or the client leaves); if this raises, the caller still owns both. With
        `assemble` (the client) the engine was asked for a stream the client did not ask for: it is
        read into one JSON answer while the client is watched (gateway.upstream.assemble). `trace`
        (llmgw.tracing) gets the first byte and the end. With `resend` (gateway.http.resume) an
        engine that breaks off is not the answer's end: a stream resumes on another endpoint, a whole
        answer is asked for again there. `charge`
        (gateway.routing.ledger.Charge): what the request's tenant was charged when it was sent, corrected
        by the usage the answer reports.

        Only generating operations teach the router an endpoint's speed; a stored response read
        again (by id) is not usage again; an answer that moved to another endpoint teaches nothing."""
        first_lease = lease
        ep = lease.choice.endpoint
        mono = self.clock.monotonic
        sse = resp.content_type.startswith("text/event-stream")
        assembling = assemble is not None and sse
        streamed = sse and not assembling
        headers = self._headers(resp, lease, rid, assembling, streamed)
        status = resp.status
        key_id = key.id if key else ANONYMOUS
        limited = bool(key and key.tpm)
        budgeted = key if key is not None and key.budget else None
        metrics, traffic, usage_of = self.metrics, self.traffic, self.usage

        learns, counts = route.learns, not route.by_id
        first_at: list[float] = []  # when the stream's first bytes came (once per request, not per chunk)
        serving = [lease]  # the lease of the endpoint answering now (another after a resume)

        def finish(completed: bool, usage, charted: bool = True) -> None:
            now = mono()
            lease, ep = serving[0], serving[0].choice.endpoint  # the endpoint that answered last
            learn = learns and lease is first_lease
            ok = completed and status < 400
            usage = usage if counts else None
            lease.release((now - t_send) if ok and learn else None, usage[1] if usage and learn else None,
                          (first_at[0] - t_send) if ok and learn and first_at else None)
            child = metrics.child
            child(metrics.requests, model, ep.id, str(status) if completed else "aborted").inc()
            child(metrics.latency, model).observe(now - t0)
            if charted:  # else the error answer raised next is counted (Proxy.refused)
                traffic.request(canon, error=not completed or status >= 500, seconds=now - t0)
                trace.finish(status, completed, usage)
            cached = getattr(usage, "cached", None)  # gateway.upstream.stream.Usage
            if cached is not None and status < 400:
                lease.router.reused(ep.id, usage[0], cached)
                child(metrics.prefix_measured, ep.id).inc(cached)
            if usage:
                child(metrics.tokens, model, "prompt").inc(usage[0])
                child(metrics.tokens, model, "completion").inc(usage[1])
            if charge is not None:  # an engine's error answer cost next to nothing: given back
                charge.done(usage if status < 400 else (0, 0))
            if status < 400:
                usage_of.record(key_id, ep.model or model, *(usage or (0, 0)), limited=limited,
                                budget=budgeted.period(self.clock.time()) if budgeted else None)

        if streamed:
            open_ = self.open

            def first() -> None:
                first_at.append(mono())
                trace.first_byte()
                waited = first_at[0] - t0
                metrics.child(metrics.ttft, model).observe(waited)
                traffic.first_byte(canon, waited)

            def finish_stream(completed: bool, usage) -> None:
                open_.n -= 1  # counted by the WSGI entry, which left it to the stream
                finish(completed, usage)

            headers += SSE_HEADERS
            if resend is not None and status < 400 and route.op in STREAMED_OPS and resend.call.body is not None:
                hop = Hop(lease, resp, None, rewrite)
                res = Resumes(route.op, resend.call.body, resend, self.stall_timeout, model,
                              self._on_hop(model, canon), trace)
                body = ResumingBody(hop, res, t0 + self.total_timeout, first, finish_stream, mono, serving)
            else:
                body = StreamBody(resp, t0 + self.total_timeout, first, finish_stream, monotonic=mono,
                                  rewrite=AnswerRewrite(model, rewrite) if status < 400 else None)
            return RawAnswer(status, headers, body)
        trace.first_byte()  # the head arrived (a whole answer's first byte); the body follows
        hops = 0
        while True:
            try:
                if assembling:
                    status, payload = self._assemble(resp, assemble, route.op == op.CHAT)
                else:
                    payload = resp.read()
                break
            except Exception as e:  # noqa: BLE001 - asked for again elsewhere, or a clean 502/504 below
                resp.close()
                gone = assembling and assemble.gone()
                again = (resend is not None and not gone and resend.off is None and hops < resend.limit
                         and status < 400)
                trace.attempt_failed("broken", status, again)
                kind = "upstream_timeout" if "timed out" in str(e).lower() else "upstream_error"
                failed = ApiError(kind, f"endpoint {ep.id} failed while answering: {type(e).__name__}")
                if again:  # nothing reached the client: the whole request goes to another endpoint
                    try:
                        hop = resend.resend(frozenset({ep.id}), None)
                    except ResendFailed as why:
                        failed = ApiError(kind, f"endpoint {ep.id} failed while answering "
                                                f"({type(e).__name__}) and no other took it: {why}")
                    else:
                        self._on_hop(model, canon)("reset", ep.id, "retried", hop.lease.choice.endpoint.id, 0)
                        log.warning("request %s: endpoint %s failed while answering (%s); asked %s again", rid, ep.id,
                                    type(e).__name__, hop.lease.choice.endpoint.id)
                        serving[0].release()
                        serving[0], resp, lease = hop.lease, hop.resp, hop.lease
                        ep, status, rewrite = lease.choice.endpoint, hop.resp.status, hop.rewrite
                        assembling = hop.assemble is not None and resp.content_type.startswith("text/event-stream")
                        assemble = hop.assemble
                        headers = self._headers(resp, lease, rid, assembling, False)
                        hops += 1
                        continue
                finish(False, None, charted=False)
                if gone:
                    metrics.child(metrics.client_gone, model, "answering").inc()
                    raise ApiError("client_gone", f"the client left while endpoint {ep.id} answered") from None
                raise failed from None
        resp.release()
        if status >= 400:  # the engine's error in the gateway's shape (a 2xx answer never comes here)
            status, payload = engine_error(status, payload, ep.id)
            headers = [h for h in headers if h[0].lower() != "content-type"]
            headers.append(("Content-Type", "application/json"))
        elif rewrite is not None or assembling or resp.content_type.startswith("application/json"):
            payload = AnswerRewrite(model, rewrite).body(payload)
        metrics.child(metrics.ttft, model).observe(mono() - t0)
        traffic.first_byte(canon, mono() - t0)
        finish(True, usage_from_json(payload) if status < 400 else None)
        headers.append(("Content-Length", str(len(payload))))
        return RawAnswer(status, headers, [payload])

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
