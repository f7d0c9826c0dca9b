"""A fake OpenAI engine that costs next to nothing per request, for the request-path benchmarks
(bench/gateway.py, bench/streams.py): one asyncio process on raw keep-alive sockets.

    python -m bench.fast_engine PORT [--answer SECONDS] [--events N]

A chat completion is answered as JSON, or, with `"stream": true`, as `--events` SSE events spread
evenly over `--answer` seconds (the first at once), then `[DONE]`; `GET /health` and
`GET /v1/models` answer too. There is no batch limit: every request is served at once, so what a
benchmark measures in front of it is the proxy, not the engine.

Why not tests/support/fake_upstream.py or simengine: both run a thread per connection. At thousands
of concurrent streams their accept loop and the GIL became the bottleneck (the engines' listen
queues overflowed, and `direct` itself showed seconds of time to first byte), which hid what the
proxies in front of them did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

COMPACT = {"separators": (",", ":")}  # as vLLM and llama-server write their JSON
MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "bench"}]}).encode()


def _json_answer(rid: int) -> bytes:
    return json.dumps({
        "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}}, **COMPACT).encode()


def _event(rid: int, i: int, last: bool) -> bytes:
    doc = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 0, "model": "m",
           "choices": [{"index": 0, "delta": {"content": f"tok{i} "} if not last else {},
                        "finish_reason": "stop" if last else None}]}
    return b"data: " + json.dumps(doc, **COMPACT).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Conn(asyncio.Protocol):
    def __init__(self, answer: float, events: int):
        self.answer, self.events = answer, events
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.n = 0

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.buf += data
        if not self.busy:
            self._next()

    def connection_lost(self, exc):
        self.transport = None

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4:end + 4 + length]
        self.buf = self.buf[end + 4 + length:]
        method, path = head.split(" ", 2)[:2]
        self.n += 1
        if method == "GET":
            self._send(200, MODELS if path.startswith("/v1/models") else b'{"status":"ok"}')
        elif b'"stream": true' in body or b'"stream":true' in body:
            self.busy = True
            asyncio.get_running_loop().create_task(self._stream(self.n))
            return
        else:
            self._send(200, _json_answer(self.n))
        if self.buf:
            self._next()

    def _send(self, status: int, body: bytes) -> None:
        if self.transport is not None:
            self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                                 % (status, len(body), body))

    async def _stream(self, rid: int) -> None:
        t = self.transport
        if t is None:
            return
        t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                + _chunk(_event(rid, 0, False)))
        gap = self.answer / max(1, self.events)
        for i in range(1, self.events):
            await asyncio.sleep(gap)
            if self.transport is None:
                return  # the client went away: stop generating
            t.write(_chunk(_event(rid, i, i == self.events - 1)))
        t.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        self.busy = False
        if self.buf:
            self._next()


async def serve(port: int, answer: float, events: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(answer, events), "127.0.0.1", port, backlog=65535)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("port", type=int)
    ap.add_argument("--answer", type=float, default=0.0, help="seconds a streamed answer takes")
    ap.add_argument("--events", type=int, default=8, help="SSE events per streamed answer")
    a = ap.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        asyncio.run(serve(a.port, a.answer, a.events))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
