"""A proxied stream written straight to the client's socket, under gunicorn's gevent worker.

gunicorn writes a WSGI body piece by piece through its Response (`write` checks the head, the length,
the framing, then gevent's `sendall` in Python): a tenth of what a proxied stream of 8 SSE events
costs in a bare proxy (docs/history.md has the measurement). For a
stream we keep gunicorn for what it does once per request (parsing, the status line and headers,
keep-alive) and write the body ourselves: each piece framed as an HTTP/1.1 chunk in one `send` on
the raw non-blocking socket beneath gevent's, falling back to gevent's `sendall` (which waits
without blocking the worker) only when the client's receive window is full. Then gunicorn is told
the answer is already written (`ALREADY_HANDLED`: it logs nothing and goes on with the connection's
next request).

A stream that does not end well (the engine broke off or the total timeout cut it) closes the client
connection without the last chunk, so the client's HTTP library reports a truncated answer instead of
a complete one (nginx does the same).

Anything else (TLS at the gateway, HTTP/1.0 clients, another server or the test client) gets the
WSGI body: `relay_target` returns None and the caller returns the answer to the server.
"""

from __future__ import annotations

try:  # the sentinel gunicorn's async workers (gevent) compare the WSGI return value with
    from gunicorn.workers.base_async import ALREADY_HANDLED
except ImportError:  # pragma: no cover - gunicorn is a dependency; other servers never relay
    ALREADY_HANDLED = None

LAST_CHUNK = b"0\r\n\r\n"


class Closing(StopIteration):
    """Raised to gunicorn after a relayed answer: close this connection (gunicorn's async worker
    ends the connection on StopIteration, as it does for its own `Connection: close`)."""


def relay_target(environ: dict, start_response):
    """gunicorn's Response behind `start_response` when this request's stream can be written to the
    socket directly (gevent worker, plain HTTP/1.1), else None."""
    if ALREADY_HANDLED is None or environ.get("wsgi.url_scheme") != "http":
        return None
    if environ.get("SERVER_PROTOCOL") != "HTTP/1.1":
        return None
    gresp = getattr(start_response, "__self__", None)
    sock = environ.get("gunicorn.socket")
    # The raw socket under gevent's: non-blocking, so a send never stalls the worker's other greenlets.
    if getattr(gresp, "sock", None) is not sock or getattr(sock, "_sock", None) is None:
        return None
    if not hasattr(gresp, "send_headers") or not hasattr(gresp, "should_close"):
        return None
    return gresp


def chunk_writer(sock):
    """write(data): `data` as one HTTP/1.1 chunk, usually in one send on the raw socket."""
    raw, sendall = sock._sock, sock.sendall

    def write(data: bytes) -> None:
        framed = b"%x\r\n%b\r\n" % (len(data), data)
        try:
            sent = raw.send(framed)
        except BlockingIOError:
            sent = 0
        if sent < len(framed):
            sendall(memoryview(framed)[sent:])  # gevent's: waits for the window, then the rest

    return write


def relay(answer, gresp, start_response):
    """Write `answer` (a RawAnswer whose body is a StreamBody) to the client and return gunicorn's
    `ALREADY_HANDLED`, or raise `Closing` when the connection must end (the stream did not complete,
    or the client or the server's shutdown asks for `Connection: close`). The body is closed in any
    case (its upstream released or closed, its slot given back, exactly once)."""
    body = answer.body
    answer.start(start_response)  # gunicorn checks the head here; if it refuses, the body is closed
    if not gresp.chunked:  # no framing for us to write (not expected on HTTP/1.1): gunicorn writes it
        return body
    try:
        gresp.send_headers()
        write = chunk_writer(gresp.sock)
        for piece in body:
            if piece:
                write(piece)
        completed = body.completed
        if completed:
            gresp.sock.sendall(LAST_CHUNK)
    finally:
        body.close()
    if not completed or gresp.should_close():
        raise Closing("relayed stream ended" if completed else "relayed stream cut short")
    return ALREADY_HANDLED
