"""An answer that survives its engine: the shell around gateway.upstream.resume.

- `Resender` is what the proxy hands an answer (the one interface to routing): `resend(exclude,
  body)` routes the request again (the proxy's own admission, never to the endpoints in `exclude`),
  sends it (`body`: the continuation; None: the request as it was), and returns the new `Hop`
  (its lease, its response), moving on past connect errors and 5xx/429 answers like the first
  attempt's retries.
- `resuming_stream` is a stream's body: it passes the engine's pieces on as `stream_body` does, and
  keeps each one it sent (an append: no parsing per piece). When the engine breaks off (the
  connection reset or closed without the answer's end, an error event, no piece within the stall
  limit), the pure `decide` says what follows: the continuation sent to another replica and its
  stream spliced in, the answer's end written, or an error event.

Each hop is counted (`llmgw_gateway_stream_resumes`), logged, a span of its own in the request's
trace (`llmgw.upstream_attempt`), and an event in the history (gateway.observe.resumes).
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from typing import Callable, Iterator

from gateway.config import GatewaySettings
from gateway.errors import ApiError
from gateway.request.call import Call
from gateway.request.client import ClientConn
from gateway.response_ids import IdRewrite
from gateway.routing.choice import Choice
from gateway.routing.retry import retryable_status
from gateway.routing.router import Lease, Router
from gateway.upstream import resume as rs
from gateway.upstream.client import Upstream, UpstreamConnectError, UpstreamResponse, UpstreamTimeout
from gateway.upstream.rewrite import AnswerRewrite
from gateway.upstream.stream import StreamBody, sse_usage
from llmgw.engines import ENGINES
from llmgw.tracing import NOOP_REQUEST

log = logging.getLogger("llmgw.gateway")


@dataclass
class Hop:
    """One endpoint's part of an answer: its slot, its response, and how its answer is read."""

    lease: Lease
    resp: UpstreamResponse
    assemble: ClientConn | None = None  # gateway.request.call.Call.assembled
    rewrite: IdRewrite | None = None


class ResendFailed(Exception):
    """No other endpoint took the request: why, in words."""


class Resender:
    """Sends a request again, to an endpoint it did not go to. `admit(call, exclude) -> Choice` is the
    proxy's admission (it raises ApiError when nothing may take the request)."""

    def __init__(self, router: Router, upstream: Upstream, admit: Callable[[Call, frozenset[str]], Choice],
                 call: Call, headers: dict[str, str], method: str, cfg: GatewaySettings, metrics=None,
                 trace=NOOP_REQUEST, rid: str = ""):
        self.router, self.upstream, self.admit, self.call = router, upstream, admit, call
        self.headers, self.method, self.retries, self.metrics = headers, method, cfg.retries, metrics
        self.trace, self.rid, self.limit = trace, rid, cfg.resumes
        self.attempt = 1  # the trace's attempt number of the next send (0 was the first)
        # Why this answer may not move to another replica (None: it may).
        canon = router.tables.canonical.get(call.model, call.model)
        self.off = (f"resuming is off for model {canon!r} (its catalog's routing.resume)"
                    if canon in router.tables.no_resume else
                    "resuming is off in this gateway (LLMGW_GATEWAY_RESUMES=0)" if not cfg.resumes else None)

    def resend(self, exclude: frozenset[str], body: dict | None) -> Hop:
        """Route and send; raises ResendFailed."""
        call = self.call if body is None else continued_call(self.call, body)
        router = self.router
        if body is not None:  # only engines that continue an answer take a continuation
            exclude = exclude | {e.id for e in router.tables.endpoints if not continues(e.engine)}
        tries = 0
        while True:
            try:
                choice = self.admit(call, exclude)
            except ApiError as e:
                raise ResendFailed(e.message) from None
            self.trace.choice(choice.endpoint.id, choice.reason, choice.saturated)
            self.trace.admitted("send")
            lease = Lease(router, choice)
            ep = choice.endpoint
            resp = None
            try:
                path, out = call.request_for(ep)
                secret = router.tables.api_keys.get(ep.id) or ep.engine_secret
                sent = {**self.headers, "authorization": f"Bearer {secret}"} if secret else dict(self.headers)
                self.trace.attempt(self.attempt, ep.id, ep.url + path)
                self.attempt += 1
                self.trace.inject(sent)
                resp = self.upstream.send(ep.url, path, out, sent, self.method)
                router.answered(ep.id)
                if not retryable_status(resp.status):
                    hop = Hop(lease, resp, call.assembled(ep), call.rewrite(ep))
                    lease = resp = None
                    return hop
                why = f"endpoint {ep.id} answered {resp.status}"
                self.trace.attempt_failed("answer", resp.status, True)
            except UpstreamConnectError as e:
                router.mark_unreachable(ep.id)
                why = f"endpoint {ep.id} could not be reached: {e}"
                self.trace.attempt_failed("connect_error", None, True)
            except UpstreamTimeout:
                router.timed_out(ep.id)
                self.trace.attempt_failed("timeout", None, False)
                raise ResendFailed(f"endpoint {ep.id} sent nothing in time") from None
            finally:
                if resp is not None:
                    resp.close()
                if lease is not None:
                    lease.release()
            if self.metrics is not None:
                self.metrics.child(self.metrics.upstream_errors, ep.id, "resend").inc()
            exclude = exclude | {ep.id}
            tries += 1
            if tries > self.retries:
                raise ResendFailed(why)


def continues(engine: str) -> bool:
    """Whether an engine continues an assistant message (llmgw.engines: `continues_answers`)."""
    e = ENGINES.get(engine)
    return bool(e is not None and e.continues_answers)


def continued_call(call: Call, body: dict) -> Call:
    """`call` with another body (the continuation), routed like it."""
    out = Call(call.route, call.model, json.dumps(body).encode(), body, call.form_at, call.pin, call.response_id,
               call.previous, call.query)
    out.adapter, out.client, out.prefix, out.prompt_tokens = call.adapter, call.client, call.prefix, call.prompt_tokens
    out.opens, out.objective = call.opens, call.objective
    return out


class Resumes:
    """What a stream's body needs to resume: the request's operation and body, the Resender, the
    limits, how a break is told (`on_hop(cause, old endpoint, outcome, new endpoint or None,
    tokens)`), and the request's trace (the broken attempt's span ends failed before the next is sent)."""

    __slots__ = ("op", "body", "resender", "stall", "model", "on_hop", "off", "limit", "trace")

    def __init__(self, op: str, body: dict, resender: Resender, stall: float, model: str,
                 on_hop: Callable[[str, str, str, str | None, int], None], trace=NOOP_REQUEST):
        self.op, self.body, self.resender, self.stall, self.model = op, body, resender, stall, model
        self.on_hop, self.off, self.limit, self.trace = on_hop, resender.off, resender.limit, trace


class ResumingBody(StreamBody):
    """The WSGI body of a stream that may resume (see `resuming_stream`). `hop` is the Hop serving it
    now; `completed`: the answer was passed on whole (the relay then writes HTTP's last chunk);
    `on_done(completed, usage)` runs once."""

    def __init__(self, hop: Hop, res: Resumes, deadline: float, on_first: Callable[[], None],
                 on_done: Callable[[bool, tuple[int, int] | None], None], monotonic: Callable[[], float],
                 serving: list | None = None):
        self.hop = hop
        self.serving = serving if serving is not None else [hop.lease]  # [the lease answering now]
        self.done = False
        self.completed = False

        def once(answered: bool, usage) -> None:
            if not self.done:
                self.done = True
                on_done(answered, usage)

        self.on_done = once
        self.gen = resuming_stream(self, res, deadline, on_first, once, monotonic)

    @property
    def resp(self) -> UpstreamResponse:  # StreamBody's, for its readers
        return self.hop.resp

    def close(self) -> None:
        self.gen.close()
        if not self.done:
            self.hop.resp.close()
            self.on_done(False, None)


def resuming_stream(body: ResumingBody, res: Resumes, deadline: float, on_first: Callable[[], None],
                    on_done: Callable[[bool, tuple[int, int] | None], None],
                    monotonic: Callable[[], float]) -> Iterator[bytes]:
    """The client's stream: the engine's pieces as they arrive (through the answer's rewrite), and at
    a break what `decide` says. Per piece: the error-event check (one substring search), an append,
    the clock. `on_done(answered, usage)` runs once, in `finally`, after the upstream is released
    (answer whole) or closed."""
    route_op, ended = res.op, rs.ended
    mark, fold_at = rs.ERROR_MARK, rs.FOLD_PIECES
    said = rs.Said()
    held: list[bytes] = []  # pieces sent and not folded yet
    before: list[bytes] = []  # the last pieces sent before the last break (folded already)
    first: bytes | None = None  # the first piece sent: the answer's id and creation time
    hops = 0
    fresh = True
    answered = False
    resp = body.hop.resp
    pieces = AnswerRewrite(res.model, body.hop.rewrite).stream(resp.chunks())
    try:
        while True:
            cause = "closed"
            try:
                for chunk in pieces:
                    if mark in chunk:
                        at = rs.error_at(chunk)
                        if at >= 0:
                            if at:
                                held.append(chunk[:at])
                                yield chunk[:at]
                            cause = "engine_error"
                            break
                    if fresh:  # this hop's first piece: tokens flow, from now a silence is a stall
                        fresh = False
                        if res.stall:
                            resp.idle_timeout(res.stall)
                        if first is None:
                            first = chunk
                            on_first()
                    held.append(chunk)
                    yield chunk
                    if len(held) > fold_at:
                        said = rs.fold(route_op, said, b"".join(held[:-2]), last=False)
                        del held[:-2]
                    if monotonic() > deadline:
                        log.warning("stream exceeded the total timeout; closing it")
                        return
                else:
                    if ended(route_op, b"".join((before + held)[-2:])):
                        answered = body.completed = True
                        return
            except socket.timeout:
                cause = "stall"
            except OSError as e:
                cause = "reset"
                log.debug("upstream stream broke: %s", e)
            # The engine broke off: what the client was sent decides what follows.
            said = rs.fold(route_op, said, b"".join(held))
            tail = (before + held)[-2:]
            before, held = tail, []
            old = body.hop.lease.choice.endpoint.id
            step = rs.decide(route_op, res.body, said, hops, res.limit, res.off)
            res.trace.attempt_failed(f"broken:{cause}", None, isinstance(step, rs.Resume))
            sep = rs.separator(tail[-1] if tail else b"")
            if isinstance(step, rs.Finish):
                res.on_hop(cause, old, "finished", None, said.tokens)
                out = sep + rs.finish_events(route_op, rs.head_of(first or b""), res.model, step)
                if out:
                    held.append(out)
                    yield out
                answered = body.completed = True
                return
            if isinstance(step, rs.Resume):
                try:
                    new = res.resender.resend(frozenset({old}), step.body)
                except ResendFailed as e:
                    step = rs.Cut("stream_resume_failed", str(e))
                else:
                    if new.resp.status >= 400 or not new.resp.content_type.startswith("text/event-stream"):
                        detail = new.resp.status
                        new.resp.close()
                        new.lease.release()
                        step = rs.Cut("stream_resume_failed", f"endpoint {new.lease.choice.endpoint.id} "
                                                              f"answered the continuation with {detail}")
            if isinstance(step, rs.Cut):
                res.on_hop(cause, old, "cut", None, said.tokens)
                log.warning("request %s: the stream on %s broke off (%s) after %d tokens and was not resumed: %s",
                            res.resender.rid, old, cause, said.tokens, step.reason)
                yield sep + rs.cut_event(route_op, step)
                return
            # Resumed: the old engine is let go, the new one's stream continues the client's.
            hops += 1
            prev, body.hop = body.hop, new
            body.serving[0] = new.lease
            prev.resp.close()
            prev.lease.release()
            res.on_hop(cause, old, "resumed", new.lease.choice.endpoint.id, said.tokens)
            log.warning("request %s: the stream on %s broke off (%s) after %d tokens; resumed on %s",
                        res.resender.rid, old, cause, said.tokens, new.lease.choice.endpoint.id)
            if sep:
                held.append(sep)
                yield sep
            resp, fresh = new.resp, True
            chunks = resp.chunks()
            if first is not None:  # else the client was sent nothing yet: the new stream is its whole answer
                chunks = _spliced(rs.Splice(route_op, rs.head_of(first), said.tokens), chunks)
            pieces = AnswerRewrite(res.model, new.rewrite).stream(chunks)
    finally:
        cur = body.hop.resp
        try:
            if answered:
                cur.release()
            else:
                cur.close()  # the engine sees the client leave and aborts
        finally:
            on_done(answered, sse_usage(b"".join((before + held)[-2:])))


def _spliced(splice: rs.Splice, chunks: Iterator[bytes]) -> Iterator[bytes]:
    for data in chunks:
        out = splice.chunk(data)
        if out:
            yield out
    tail = splice.end()
    if tail:
        yield tail
