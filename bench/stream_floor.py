"""What serving a stream costs before any proxying: the floor under the gateway's CPU per request.

Two stand-ins answer bench/streams.py's requests the way its fake engines do (the same 8 SSE events
over the same answer time, the first at once) with no engine behind them, no routing and no
accounting:

- `floor-gunicorn`: a WSGI app under the gateway's own gunicorn config (the gevent worker), its body
  written by gunicorn: what the server model costs per streamed request;
- `floor-gevent`: the same answer from a bare gevent StreamServer with hand-written HTTP/1.1: what
  Python and gevent cost with no server framework at all.

The gateway's CPU per request minus these is what proxying (the engine's socket, routing, accounting)
costs; these minus nginx's is the price of Python. Used by `python -m bench.streams --targets
...,floor-gunicorn,floor-gevent`; `python -m bench.stream_floor PORT` runs the gevent one alone.
"""

from __future__ import annotations

import os
import resource
import socket
import sys

import gevent

# Thousands of streams need more descriptors than the default soft limit (the gateway raises its own).
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)

EVENTS = int(os.environ.get("FLOOR_EVENTS", "8"))
ANSWER_S = float(os.environ.get("FLOOR_ANSWER_S", "1.6"))
EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
         b'"delta":{"content":"t0 t1 t2 t3 t4 t5 t6 t7 "},"finish_reason":null}]}\n\n')


def events():
    """The answer's events, paced like the fake engine's: one per ANSWER_S / EVENTS, the first at once."""
    for _ in range(EVENTS):
        yield EVENT
        gevent.sleep(ANSWER_S / EVENTS)
    yield b"data: [DONE]\n\n"


def app(environ, start_response):
    """floor-gunicorn: `gunicorn -c python:gateway.gunicorn_conf bench.stream_floor:app`."""
    environ["wsgi.input"].read()
    start_response("200 OK", [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")])
    return events()


HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def handle(sock, _addr) -> None:
    """floor-gevent: keep-alive HTTP/1.1, requests with a Content-Length, answers chunked."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as gunicorn does: no Nagle delay
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(buf) < length:
            data = sock.recv(65536)
            if not data:
                return
            buf += data
        buf = buf[length:]
        sock.sendall(HEAD)
        for ev in events():
            sock.sendall(b"%x\r\n%b\r\n" % (len(ev), ev))
        sock.sendall(b"0\r\n\r\n")


def main() -> None:
    from gevent import monkey

    monkey.patch_all()
    from gevent.server import StreamServer

    server = StreamServer(("127.0.0.1", int(sys.argv[1])), handle, backlog=4096)
    server.max_accept = 1000
    server.serve_forever()


if __name__ == "__main__":
    main()
