"""An engine's answer passed on as it arrives, and the usage it reports.

Streams are never buffered: the WSGI body (`StreamBody`) yields each piece as one receive completed
it, and the upstream response is closed in `finally` whether the stream ended or the client went
away, so the engine stops generating.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Iterator

from gateway.upstream.client import UpstreamResponse
from gateway.upstream.rewrite import AnswerRewrite

log = logging.getLogger("llmgw.gateway")


def usage_from_json(body: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from an OpenAI JSON answer or stream event, if it reports them: a
    chat answer's `usage`, or a response's (the Responses API calls them input and output tokens; a
    stream's last event carries them in its `response`)."""
    if b'"usage"' not in body:
        return None
    try:
        doc = json.loads(body)
        u = doc.get("usage") or (doc.get("response") or {}).get("usage") or {}
        return (int(u.get("prompt_tokens") or u.get("input_tokens") or 0),
                int(u.get("completion_tokens") or u.get("output_tokens") or 0))
    except (ValueError, AttributeError, TypeError, RecursionError):  # an engine's answer is input too
        return None


def sse_usage(tail: bytes) -> tuple[int, int] | None:
    """The `usage` an engine puts in a stream's last event (when asked to), from the stream's tail."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    start = tail.rfind(b"data:", 0, at)
    if start < 0:
        return None
    end = tail.find(b"\n", at)
    got = usage_from_json(tail[start + 5:end if end >= 0 else len(tail)].strip())
    return got if got is not None and (got[0] or got[1]) else None


class StreamBody:
    """The WSGI body of a proxied stream. The server calls `close()` when it is done with it, even if
    it never iterated (client gone before the first write): the upstream is then closed and
    `on_done` still runs, exactly once."""

    def __init__(self, resp: UpstreamResponse, deadline: float, on_first: Callable[[], None],
                 on_done: Callable[[bool, tuple[int, int] | None], None],
                 monotonic: Callable[[], float] = time.monotonic,
                 rewrite: AnswerRewrite | None = None):
        self.resp = resp
        self.done = False
        self.completed = False  # the engine's whole answer was passed on

        def once(completed: bool, usage) -> None:
            if not self.done:
                self.done, self.completed = True, completed
                on_done(completed, usage)

        self.on_done = once
        self.gen = stream_body(resp, deadline, on_first, once, monotonic, rewrite)

    def __iter__(self) -> Iterator[bytes]:
        return self.gen

    def close(self) -> None:
        self.gen.close()  # runs stream_body's finally if it had started
        if not self.done:
            self.resp.close()
            self.on_done(False, None)


def stream_body(resp: UpstreamResponse, deadline: float, on_first: Callable[[], None],
                on_done: Callable[[bool, tuple[int, int] | None], None],
                monotonic: Callable[[], float] = time.monotonic,
                rewrite: AnswerRewrite | None = None) -> Iterator[bytes]:
    """Yield the engine's bytes as they arrive (through `rewrite`, when given: the model's name, a
    Responses stream's ids; gateway.upstream.rewrite). `on_done(completed, usage)` runs exactly
    once, in `finally`, after the upstream is released (stream ended) or closed (client gone, error).

    Per chunk only a read, a write (the yield) and a clock check: usage is looked for once, at the
    end, in the last two chunks (the usage event and `[DONE]` may arrive apart)."""
    completed = False
    prev = last = b""
    try:
        pieces = resp.chunks() if rewrite is None else rewrite.stream(resp.chunks())
        for chunk in pieces:
            on_first()
            yield chunk
            prev, last = last, chunk
            break
        for chunk in pieces:
            yield chunk
            prev, last = last, chunk
            if monotonic() > deadline:
                log.warning("stream exceeded the total timeout; closing it")
                return
        completed = True
    except OSError as e:
        log.warning("upstream stream broke after the first byte: %s", e)
    finally:
        try:
            if completed:
                resp.release()
            else:
                resp.close()  # drop the connection: the engine sees the client leave and aborts
        finally:
            on_done(completed, sse_usage(prev + last))
