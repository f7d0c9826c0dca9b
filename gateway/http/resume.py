"""A stream that survives its engine: the shell around gateway.upstream.resume.

`ResumingBody` is a stream's WSGI body: it passes the engine's pieces on as `stream_body` does, and
keeps each one it sent (an append: no parsing per piece). When the engine breaks off (the connection
reset or closed without the answer's end, an error event, no piece within the stall limit), the pure
`decide` says what follows: the continuation sent through the request's Exchange (gateway.http.attempt,
the one place a request is sent) to another replica and its stream spliced in, the answer's end
written, or an error event.

Each hop is counted (`llmgw_gateway_stream_resumes`), logged, a span of its own in the request's
trace (`llmgw.upstream_attempt`), and an event in the history (gateway.observe.resumes).
"""

from __future__ import annotations

import logging
import socket
from typing import Callable, Iterator

from gateway.errors import ApiError
from gateway.http.attempt import Exchange, Hop
from gateway.routing.router import Lease
from gateway.upstream import resume as rs
from gateway.upstream.rewrite import AnswerRewrite
from gateway.upstream.stream import StreamBody, sse_usage

log = logging.getLogger("llmgw.gateway")

OnHop = Callable[[str, str, str, "str | None", int], None]  # (cause, old endpoint, outcome, new endpoint, tokens)


class ResumingBody(StreamBody):
    """The WSGI body of a stream that may resume. `hop` is the Hop serving it now; `completed`: the
    answer was passed on whole (the relay then writes HTTP's last chunk); `on_done(completed, usage,
    lease)` runs once, after the upstream is released (answer whole) or closed, with the lease of the
    endpoint that answered last. `stall`: seconds without a piece after the first that count as a
    break; `on_hop` is told of each break."""

    def __init__(self, hop: Hop, ex: Exchange, stall: float, deadline: float, on_first: Callable[[], None],
                 on_done: Callable[[bool, tuple[int, int] | None, Lease], None], monotonic: Callable[[], float],
                 on_hop: OnHop, model: str):
        self.hop, self.ex, self.stall, self.on_hop, self.model = hop, ex, stall, on_hop, model
        self.op = ex.call.route.op
        self.done = self.completed = False
        self.said = rs.Said()
        self.held: list[bytes] = []  # pieces sent and not folded yet
        self.before: list[bytes] = []  # the last pieces sent before the last break (folded already)
        self.first: bytes | None = None  # the first piece sent: the answer's id and creation time
        self.hops = 0

        def once(answered: bool, usage) -> None:
            if not self.done:
                self.done = True
                on_done(answered, usage, self.hop.lease)

        self.on_done = once
        self.gen = self._stream(deadline, on_first, monotonic)

    @property
    def resp(self):  # StreamBody's, for its readers
        return self.hop.resp

    def close(self) -> None:
        self.gen.close()
        if not self.done:
            self.hop.resp.close()
            self.on_done(False, None)

    def _stream(self, deadline: float, on_first: Callable[[], None], monotonic: Callable[[], float]) -> Iterator[bytes]:
        """The client's stream: the engine's pieces as they arrive (through the answer's rewrite), and
        at a break what `_broke` says."""
        answered = False
        pieces = self._pieces(self.hop)
        try:
            while True:
                cause = yield from self._relay(pieces, deadline, on_first, monotonic)
                if cause is not None:
                    out, pieces = self._broke(cause)
                    if out:
                        yield out
                if cause is None or pieces is None:
                    answered = self.completed
                    return
        finally:
            cur = self.hop.resp
            try:
                if answered:
                    cur.release()
                else:
                    cur.close()  # the engine sees the client leave and aborts
            finally:
                self.on_done(answered, sse_usage(b"".join((self.before + self.held)[-2:])))

    def _relay(self, pieces: Iterator[bytes], deadline: float, on_first: Callable[[], None],
               monotonic: Callable[[], float]):
        """Pass one hop's pieces on; returns why it broke off (None: the answer ended, or its time ran
        out). Per piece: the error-event check (one substring search), an append, the clock."""
        held, route_op, mark, fold_at = self.held, self.op, rs.ERROR_MARK, rs.FOLD_PIECES
        fresh = True
        try:
            for chunk in pieces:
                if mark in chunk:
                    at = rs.error_at(chunk)
                    if at >= 0:
                        if at:
                            held.append(chunk[:at])
                            yield chunk[:at]
                        return "engine_error"
                if fresh:  # this hop's first piece: tokens flow, from now a silence is a stall
                    fresh = False
                    if self.stall:
                        self.hop.resp.idle_timeout(self.stall)
                    if self.first is None:
                        self.first = chunk
                        on_first()
                held.append(chunk)
                yield chunk
                if len(held) > fold_at:
                    self.said = rs.fold(route_op, self.said, b"".join(held[:-2]), last=False)
                    del held[:-2]
                if monotonic() > deadline:
                    log.warning("stream exceeded the total timeout; closing it")
                    return None
        except socket.timeout:
            return "stall"
        except OSError as e:
            log.debug("upstream stream broke: %s", e)
            return "reset"
        if rs.ended(route_op, b"".join((self.before + held)[-2:])):
            self.completed = True
            return None
        return "closed"

    def _broke(self, cause: str) -> tuple[bytes, Iterator[bytes] | None]:
        """The engine broke off: what the client was sent decides what follows. Returns what to send
        the client now, and the stream that continues the answer (None: the answer ends here)."""
        ex, route_op = self.ex, self.op
        self.said = said = rs.fold(route_op, self.said, b"".join(self.held))
        tail = (self.before + self.held)[-2:]
        self.before, self.held = tail, []
        old = self.hop.choice.endpoint.id
        step = rs.decide(route_op, ex.call.body, said, self.hops, ex.sender.cfg.resumes, ex.resume_off())
        ex.trace.attempt_failed(f"broken:{cause}", None, isinstance(step, rs.Resume))
        sep = rs.separator(tail[-1] if tail else b"")
        if isinstance(step, rs.Finish):
            self.on_hop(cause, old, "finished", None, said.tokens)
            self.completed = True
            out = sep + rs.finish_events(route_op, rs.head_of(self.first or b""), self.model, step)
            if out:
                self.held.append(out)
            return out, None
        new = None
        if isinstance(step, rs.Resume):
            new, step = self._resend(old, step)
        if isinstance(step, rs.Cut):
            self.on_hop(cause, old, "cut", None, said.tokens)
            log.warning("request %s: the stream on %s broke off (%s) after %d tokens and was not resumed: %s",
                        ex.rid, old, cause, said.tokens, step.reason)
            return sep + rs.cut_event(route_op, step), None
        # Resumed: the old engine is let go, the new one's stream continues the client's.
        self.hops += 1
        prev, self.hop = self.hop, new
        prev.close()
        self.on_hop(cause, old, "resumed", new.choice.endpoint.id, said.tokens)
        log.warning("request %s: the stream on %s broke off (%s) after %d tokens; resumed on %s",
                    ex.rid, old, cause, said.tokens, new.choice.endpoint.id)
        if sep:
            self.held.append(sep)
        return sep, self._pieces(new)

    def _resend(self, old: str, step: rs.Resume) -> tuple[Hop | None, rs.Resume | rs.Cut]:
        """The continuation, sent through the request's Exchange to an endpoint other than `old`."""
        try:
            new = self.ex.send(self.ex.call.continued(step.body), frozenset({old}))
        except ApiError as e:
            return None, rs.Cut("stream_resume_failed", e.message)
        if new.resp.status >= 400 or not new.resp.content_type.startswith("text/event-stream"):
            detail = new.resp.status
            new.close()
            return None, rs.Cut("stream_resume_failed", f"endpoint {new.choice.endpoint.id} answered the "
                                                        f"continuation with {detail}")
        return new, step

    def _pieces(self, hop: Hop) -> Iterator[bytes]:
        """A hop's stream as the client reads it: after a break, spliced into the answer it continues
        (else the client was sent nothing yet: the new stream is its whole answer)."""
        chunks = hop.resp.chunks()
        if self.hops and self.first is not None:
            chunks = _spliced(rs.Splice(self.op, rs.head_of(self.first), self.said.tokens), chunks)
        return AnswerRewrite(self.model, hop.ask.rewrite).stream(chunks)


def _spliced(splice: rs.Splice, chunks: Iterator[bytes]) -> Iterator[bytes]:
    for data in chunks:
        out = splice.chunk(data)
        if out:
            yield out
    tail = splice.end()
    if tail:
        yield tail
