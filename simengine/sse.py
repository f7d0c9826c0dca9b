"""The simulated engine's streamed answers: chunked SSE written as tokens come from the batching core.

When the response head and the first chunks leave follows the engine the sim stands for
(`ServerOptions.start`): vLLM sends the head at once (its StreamingResponse starts before the engine
has the request) and the `role` chunk with the first token (chat_completion_stream_generator writes
both on the first engine output); llama-server sends nothing until the first token exists
(handle_completions_impl waits for the first result), then head, role chunk and token together;
`early` sends head and role chunk at once. A client that goes away cancels the request.
"""

from __future__ import annotations

import queue
import time
from typing import Any, BinaryIO, Callable

from simengine import openai as oa
from simengine import responses as rapi
from simengine.core import Emit

STREAM_STARTS = ("vllm", "llamacpp", "early")  # ServerOptions.start: the engine whose timing a stream has
DISCONNECTED = (BrokenPipeError, ConnectionResetError, TimeoutError, OSError)


class Writer:
    """One chunked `text/event-stream` answer on a connection."""

    def __init__(self, out: BinaryIO, send_head: Callable[[], None]):
        self.out, self._send_head, self.headed = out, send_head, False

    def head(self) -> None:
        if not self.headed:
            self._send_head()
            self.headed = True

    def write(self, data: bytes) -> None:
        self.head()
        self.out.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self) -> None:
        self.write(b"")  # the chunked body's last chunk


class ClosedEarly(Exception):
    """The stream was ended on purpose before the answer's end (--close-early)."""


def stream_completion(w: Writer, start: str, job: oa.Job, chunks: oa.Chunks, q: "queue.SimpleQueue[Emit]",
                      words: list[str], llamacpp: bool, close_early: int | None = None) -> tuple[int | None, float, float]:
    """Write a chat or text completion stream; returns (cached prompt tokens, time to first token,
    time to last) measured here, for llama-server's timings. With `close_early`, the body ends after
    that many tokens without the answer's end, and ClosedEarly is raised."""
    t0 = time.monotonic()
    if start != "llamacpp":
        w.head()
        if start == "early" and job.chat:
            w.write(chunks.role())
    cached, first = None, 0.0
    for i, word in enumerate(words):
        e = q.get()
        if i == 0:
            cached, first = e.cached, time.monotonic() - t0
            if job.chat and start != "early":
                w.write(chunks.role(None if llamacpp else ""))
        timings = None
        if e.done and llamacpp:
            timings = oa.timings(len(job.tokens) - (cached or 0), cached or 0, first, job.max_tokens,
                                 time.monotonic() - t0 - first)
        w.write(chunks.token(word, e.done, timings))
        if e.done:
            break
        if close_early is not None and i + 1 >= close_early:
            w.end()
            raise ClosedEarly()
    if job.include_usage:
        w.write(chunks.usage(cached if llamacpp else None))
    w.write(b"data: [DONE]\n\n")
    w.end()
    return cached, first, time.monotonic() - t0


class ClientGone(Exception):
    """The client of a non-streamed answer closed its connection before the answer was complete."""


# How often a non-streamed answer looks at its client's connection while it waits for tokens.
GONE_CHECK = 0.02


def peer_closed(sock) -> bool:
    """The client closed its end of `sock` (readable, and a peek reads nothing): vLLM's API server
    notices the same for a non-streamed request and aborts it."""
    import select
    import socket

    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def whole_answer(q: "queue.SimpleQueue[Emit]", words: list[str],
                 gone: Callable[[], bool] | None = None) -> tuple[str, int | None, float, float]:
    """A non-streamed answer: one word per token event, until the last; with the cached prompt tokens
    and the times to the first and last token. With `gone`, checked every GONE_CHECK seconds while it
    waits, raises ClientGone once the client has left (the caller aborts the request)."""
    t0 = time.monotonic()
    out, cached, first = [], None, 0.0
    for i, word in enumerate(words):
        while True:
            try:
                e = q.get(timeout=GONE_CHECK) if gone is not None else q.get()
                break
            except queue.Empty:
                if gone():
                    raise ClientGone() from None
        if i == 0:
            cached, first = e.cached, time.monotonic() - t0
        out.append(word)
        if e.done:
            break
    return "".join(out), cached, first, time.monotonic() - t0


def stream_responses(w: Writer, q: "queue.SimpleQueue[Emit]", words: list[str], started: dict, msg_id: str,
                     final: Callable[[str], dict], close_early: int | None = None) -> dict:
    """The Responses API's named events, one delta per token; returns the completed response (with
    `close_early`: ends the body after that many deltas and raises ClosedEarly)."""
    ev = rapi.Events()
    w.write(ev.frame("response.created", response=started))
    w.write(ev.frame("response.in_progress", response=started))
    w.write(ev.frame("response.output_item.added", output_index=0, item=rapi.message(msg_id, "", "in_progress")))
    part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
    w.write(ev.frame("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part))
    out = []
    for word in words:
        e = q.get()
        out.append(word)
        w.write(ev.frame("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                         delta=word, logprobs=[]))
        if e.done:
            break
        if close_early is not None and len(out) >= close_early:
            w.end()
            raise ClosedEarly()
    resp = final("".join(out))
    done_text = resp["output"][0]["content"][0]
    w.write(ev.frame("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
                     text=done_text["text"], logprobs=[]))
    w.write(ev.frame("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=done_text))
    w.write(ev.frame("response.output_item.done", output_index=0, item=resp["output"][0]))
    w.write(ev.frame("response.completed", response=resp))
    w.end()
    return resp
