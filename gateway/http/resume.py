"""A stream that survives its engine: the shell around gateway.upstream.resume.

`ResumingBody` is a stream's WSGI body: it passes the engine's pieces on as `stream_body` does, and
keeps each one it sent (an append: no parsing per piece). When the engine breaks off (the connection
reset or closed without the answer's end, an error event, no piece within the stall limit), the pure
`decide` says what follows: the continuation sent as the request's next send (`Proxied.send`, gateway.http.attempt,
the one place a request is sent) to another replica and its stream spliced in, the answer's end
written, or an error event.

Each hop is counted (`llmgw_gateway_stream_resumes`), logged, a span of its own in the request's
trace (`llmgw.upstream_attempt`), and an event in the history (gateway.observe.resumes).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Iterator

from gateway.errors import ApiError
from gateway.http.attempt import Proxied, Hop
from gateway.routing import eviction as ev
from gateway.routing.router import Lease
from gateway.upstream import resume as rs
from gateway.upstream.rewrite import AnswerRewrite
from gateway.upstream.stream import StreamBody, sse_usage

log = logging.getLogger("llmgw.gateway")

OnHop = Callable[[str, str, str, "str | None", int], None]  # (cause, old endpoint, outcome, new endpoint, tokens)
EVICTED = "evicted"  # the cause of a break the gateway made itself: the answer's slot went to another request
PAUSED = b": llmgw: paused; the answer goes on when a slot frees\n\n"  # an SSE comment: clients ignore it


class Pause:
    """How a paused stream (its continuation waiting for a slot) keeps its client: an SSE comment every
    `keepalive` seconds; and what each pause is counted by: `paused(model, seconds, tokens resent)`."""

    def __init__(self, keepalive: float = 5.0, clock: Callable[[], float] = time.monotonic, metrics=None):
        self.keepalive, self.clock, self.metrics = keepalive, clock, metrics

    def paused(self, model: str, seconds: float, evicted_tokens: int) -> None:
        m = self.metrics
        if m is not None:
            m.child(m.pause_seconds, model).observe(seconds)
            if evicted_tokens:
                m.child(m.evicted_tokens, model).inc(evicted_tokens)

    def prefill(self, model: str, prompt: int, cached: int | None) -> None:
        """A continuation's answer ended: its engine read `prompt` tokens, `cached` of them from cache."""
        m = self.metrics
        if m is not None and cached is not None:
            m.child(m.resume_prefill, model, "cached").inc(min(cached, prompt))
            m.child(m.resume_prefill, model, "computed").inc(max(0, prompt - cached))


class ResumingBody(StreamBody):
    """The WSGI body of a stream that may resume. `hop` is the Hop serving it now; `completed`: the
    answer was passed on whole (the relay then writes HTTP's last chunk); `on_done(completed, usage,
    lease)` runs once, after the upstream is released (answer whole) or closed, with the lease of the
    endpoint that answered last. `stall`: seconds without a piece after the first that count as a
    break; `on_hop` is told of each break. With `evictions` (gateway.http.evictions) it is registered
    there while it runs: a waiting request that outranks it may `evict` it. `pause` is what tells the
    client a paused stream is still there (`keepalive` seconds apart) and what a pause is counted by."""

    def __init__(self, hop: Hop, ex: Proxied, stall: float, deadline: float, on_first: Callable[[], None],
                 on_done: Callable[[bool, tuple[int, int] | None, Lease], None], monotonic: Callable[[], float],
                 on_hop: OnHop, model: str, evictions=None, pause: "Pause | None" = None):
        self.hop, self.ex, self.stall, self.on_hop, self.model = hop, ex, stall, on_hop, model
        self.op = ex.call.route.op
        self.done = self.completed = False
        self.said = rs.Said()
        self.held: list[bytes] = []  # pieces sent and not folded yet
        self.before: list[bytes] = []  # the last pieces sent before the last break (folded already)
        self.first: bytes | None = None  # the first piece sent: the answer's id and creation time
        self.hops = 0  # breaks resumed (bounded by LLMGW_GATEWAY_RESUMES)
        self.pieces = 0  # pieces sent: one token each on vLLM and llama-server
        self.evictions = 0  # times it was evicted (bounded by eviction's settings)
        self.paused = False  # its continuation waits for a slot: it holds none, and may not be evicted
        self.evicting: str | None = None  # why it is being evicted now
        self.resent = 0  # tokens of the answer the last continuation sent back as its prompt
        self.pause = pause or Pause()
        self.registry, self.ident = evictions, (evictions.add(ex.call.model, self) if evictions is not None else 0)

        def once(answered: bool, usage) -> None:
            if not self.done:
                self.done = True
                if self.registry is not None:
                    self.registry.remove(self.ident)
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
                    pieces = yield from self._broke(cause)
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
                usage = sse_usage(b"".join((self.before + self.held)[-2:]))
                if usage is not None and (self.hops or self.evictions):  # the splice moved the resent tokens
                    self.pause.prefill(self.model, usage[0] + self.resent, getattr(usage, "cached", None))
                self.on_done(answered, usage)

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
                self.pieces += 1
                yield chunk
                if len(held) > fold_at:
                    self.said = rs.fold(route_op, self.said, b"".join(held[:-2]), last=False)
                    del held[:-2]
                if monotonic() > deadline:
                    log.warning("stream exceeded the total timeout; closing it")
                    return None
        except socket.timeout:
            return EVICTED if self.evicting else "stall"
        except OSError as e:
            log.debug("upstream stream broke: %s", e)
            return EVICTED if self.evicting else "reset"
        if rs.ended(route_op, b"".join((self.before + held)[-2:])):
            self.completed = True
            return None
        return EVICTED if self.evicting else "closed"

    def _broke(self, cause: str):
        """The engine broke off, or the answer was evicted: what the client was sent decides what
        follows. Yields what to send the client meanwhile; returns the stream that continues the
        answer (None: the answer ends here)."""
        ex, route_op = self.ex, self.op
        self.said = said = rs.fold(route_op, self.said, b"".join(self.held))
        tail = (self.before + self.held)[-2:]
        self.before, self.held = tail, []
        old = self.hop.choice.endpoint.id
        evicted = cause == EVICTED
        step = rs.decide(route_op, ex.call.body, said, self.hops, ex.sender.cfg.resumes, ex.resume_off())
        ex.trace.attempt_failed(f"broken:{cause}", None, isinstance(step, rs.Resume))
        sep = rs.separator(tail[-1] if tail else b"")
        if isinstance(step, rs.Finish):
            self.on_hop(cause, old, "finished", None, said.tokens)
            self.completed = True
            out = sep + rs.finish_events(route_op, rs.head_of(self.first or b""), self.model, step)
            if out:
                self.held.append(out)
                yield out
            return None
        if isinstance(step, rs.Cut):
            return (yield from self._cut(cause, old, step, sep))
        # The old engine is let go first: an evicted answer's slot is what the waiting request takes.
        self._pausing(True)
        self.hop.close()
        if sep:
            self.held.append(sep)
            yield sep
        if evicted:
            self.evictions += 1
            self.evicting = None
        new, step = yield from self._resend(old, step, evicted)
        self._pausing(False)
        if isinstance(step, rs.Cut):
            return (yield from self._cut(cause, old, step, b""))
        if not evicted:
            self.hops += 1
        self.hop, self.resent = new, said.tokens
        self.on_hop(cause, old, "resumed", new.choice.endpoint.id, said.tokens)
        log.log(logging.INFO if evicted else logging.WARNING,
                "request %s: the stream on %s %s after %d tokens; resumed on %s", ex.rid, old,
                "was evicted" if evicted else f"broke off ({cause})", said.tokens, new.choice.endpoint.id)
        return self._pieces(new)

    def _cut(self, cause: str, old: str, step: rs.Cut, sep: bytes):
        """End the stream with an error event (`sep` first completes the last event sent)."""
        self.on_hop(cause, old, "cut", None, self.said.tokens)
        log.warning("request %s: the stream on %s broke off (%s) after %d tokens and was not resumed: %s",
                    self.ex.rid, old, cause, self.said.tokens, step.reason)
        yield sep + rs.cut_event(self.op, step)
        return None

    def _resend(self, old: str, step: rs.Resume, evicted: bool):
        """The continuation, sent as the request's next send (an evicted answer's may go back to its
        own endpoint, which holds its prompt in cache; a broken one's never), while the client is told
        the stream is paused. Returns the new Hop and the step, or None and the Cut."""
        paused_at = self.pause.clock()
        box: list = []
        done = threading.Event()
        lock = threading.Lock()
        call, exclude = self.ex.call.continued(step.body), frozenset() if evicted else frozenset({old})

        def send() -> None:
            try:
                got = self.ex.send(call, exclude)
            except BaseException as e:  # noqa: BLE001 - handed to the stream, which ends with it
                got = e
            with lock:
                if box:  # the client left meanwhile: nobody takes the hop
                    if isinstance(got, Hop):
                        got.close()
                    return
                box.append(got)
                done.set()

        threading.Thread(target=send, name="llmgw-resume", daemon=True).start()
        try:
            while not done.wait(self.pause.keepalive):
                yield PAUSED
        finally:
            with lock:
                if not box:
                    box.append(None)  # the client left: the sender closes what it gets
        got = box[0]
        self.pause.paused(self.model, self.pause.clock() - paused_at, self.said.tokens if evicted else 0)
        if not isinstance(got, Hop):
            why = got.message if isinstance(got, ApiError) else f"{type(got).__name__}: {got}"
            return None, rs.Cut("stream_resume_failed", why)
        if got.resp.status >= 400 or not got.resp.content_type.startswith("text/event-stream"):
            detail = got.resp.status
            got.close()
            return None, rs.Cut("stream_resume_failed", f"endpoint {got.choice.endpoint.id} answered the "
                                                        f"continuation with {detail}")
        return got, step

    # --- eviction (gateway.http.evictions) ----------------------------------------------------------
    def running(self, ident: int, counter: Callable[[str], float], now: float) -> ev.Running:
        """This answer as eviction reads it."""
        plan, hop = self.ex.plan, self.hop
        key = plan.tenant.key if plan.tenant is not None else ""
        return ev.Running(ident, hop.choice.endpoint.id, plan.priority, key, counter(key) if key else 0.0,
                          self.pieces, now - hop.sent_at, self.evictions, self.fixed())

    @property
    def klass(self) -> str:
        return self.ex.plan.priority

    @property
    def key(self) -> str:
        tenant = self.ex.plan.tenant
        return tenant.key if tenant is not None else ""

    def brief(self) -> tuple[str, int, float, int, bool]:
        """What the sibling workers read of it (gateway.server.board): no parsing."""
        return (self.hop.choice.endpoint.id, self.pieces, self.hop.sent_at, self.evictions,
                self.done or self.paused or self.evicting is not None)

    @property
    def holding(self) -> bool:
        """It holds a slot: it runs, or is being evicted and has not given it back yet."""
        return not (self.done or self.paused)

    def _pausing(self, paused: bool) -> None:
        self.paused = paused
        if self.registry is not None:
            self.registry.changed(self.ident, self)

    def fixed(self) -> str | None:
        """Why this answer may not be evicted now (None: it resumes exactly)."""
        if self.done or self.evicting is not None:
            return "it is ending, or being evicted already"
        if self.paused:
            return "it is paused already, holding no slot"
        off = self.ex.resume_off()
        if off is not None:
            return off
        said = rs.fold(self.op, self.said, b"".join(self.held), last=False)
        return rs.refusal(self.op, self.ex.call.body, said)

    def evict(self, reason: str) -> None:
        """Pause this answer: its engine's connection is shut (the engine aborts and frees the slot),
        and the stream resumes from where it stopped (`_broke`)."""
        if self.done or self.evicting is not None:
            return
        self.evicting = reason
        self.hop.resp.shutdown()

    def _pieces(self, hop: Hop) -> Iterator[bytes]:
        """A hop's stream as the client reads it: after a break, spliced into the answer it continues
        (else the client was sent nothing yet: the new stream is its whole answer)."""
        chunks = hop.resp.chunks()
        if (self.hops or self.evictions) and self.first is not None:
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
