"""Forwarding to engines over pooled keep-alive connections, and streaming their answers back.

A small LIFO pool of `http.client` connections per endpoint (thread-safe; measured ~0.3 ms per request
cheaper than urllib3 on this path) keeps connections to every endpoint open. Streams are passed
through chunk by chunk as the engine sends them (never buffered), and the upstream response is closed
in `finally` whether the stream ended or the client went away, so the engine stops generating.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from typing import Callable, Iterator
from urllib.parse import urlsplit

log = logging.getLogger("llmgw.gateway")

# Engine response headers not passed on: hop-by-hop ones, those the server sets itself, and
# X-Request-Id (the gateway sends its own, once; an engine that echoes it would make it two).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "content-length", "content-encoding", "server", "date", "x-request-id",
})
# ... and for a stream also its caching headers: the gateway sets its own (app.SSE_HEADERS).
STREAM_REPLACED = HOP_BY_HOP | {"cache-control", "x-accel-buffering"}
# Request headers an engine needs; everything else (the client's API key above all) stays here.
FORWARD_REQUEST_HEADERS = (
    ("content-type", "CONTENT_TYPE"), ("accept", "HTTP_ACCEPT"), ("user-agent", "HTTP_USER_AGENT"),
    ("x-session-id", "HTTP_X_SESSION_ID"),
)  # (header, WSGI environ key); X-Request-Id is always set
# A reused keep-alive connection the engine had already closed fails with one of these before the
# engine read anything: safe to send again on a fresh connection.
STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError, BrokenPipeError)


class UpstreamConnectError(Exception):
    """Nothing reached the engine (refused, unreachable, connect timeout): safe to retry elsewhere."""


class UpstreamTimeout(Exception):
    """The engine accepted the request but sent no first byte in time."""


class UpstreamResponse:
    """An engine's answer with its body unread, and the connection it came on."""

    def __init__(self, upstream: "Upstream", key: tuple[str, int], conn: http.client.HTTPConnection,
                 resp: http.client.HTTPResponse):
        self.upstream, self.key, self.conn, self.resp = upstream, key, conn, resp
        self.status = resp.status
        self.headers = resp.headers
        self.read1 = resp.read1  # whatever the engine sent so far, as soon as it arrives
        self.done = False  # released or closed: later calls do nothing (the conn may be reused)

    def read(self) -> bytes:
        return self.resp.read()

    def release(self) -> None:
        """Body fully read: the connection goes back to the pool (unless the engine closes it)."""
        if self.done:
            return
        if self.resp.will_close or not self.resp.isclosed():
            self.close()
        else:
            self.done = True
            self.upstream._put(self.key, self.conn)

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.conn.close()


class _Connection(http.client.HTTPConnection):
    """http.client sends the head and a bytes body in two writes (two packets with TCP_NODELAY, and
    an extra wake-up of the engine's reader); one write is measurably cheaper on this path."""

    def _send_output(self, message_body=None, encode_chunked=False):
        if isinstance(message_body, bytes) and not encode_chunked:
            self._buffer.extend((b"", b""))
            msg = b"\r\n".join(self._buffer)
            del self._buffer[:]
            self.send(msg + message_body)
            return
        super()._send_output(message_body, encode_chunked)


class Upstream:
    def __init__(self, connect_timeout: float, first_byte_timeout: float, pool_size: int = 256):
        self.connect_timeout, self.first_byte_timeout = connect_timeout, first_byte_timeout
        self.pool_size = pool_size
        self.idle: dict[tuple[str, int], list[http.client.HTTPConnection]] = {}
        self.lock = threading.Lock()
        self.hosts: dict[str, tuple[str, int]] = {}

    def _key(self, base_url: str) -> tuple[str, int]:
        key = self.hosts.get(base_url)
        if key is None:
            u = urlsplit(base_url)
            key = self.hosts[base_url] = (u.hostname or "127.0.0.1", u.port or 80)
        return key

    def _get(self, key: tuple[str, int]) -> http.client.HTTPConnection | None:
        with self.lock:
            conns = self.idle.get(key)
            return conns.pop() if conns else None

    def _put(self, key: tuple[str, int], conn: http.client.HTTPConnection) -> None:
        with self.lock:
            conns = self.idle.setdefault(key, [])
            if len(conns) < self.pool_size:
                conns.append(conn)
                return
        conn.close()

    def _connect(self, key: tuple[str, int]) -> http.client.HTTPConnection:
        conn = _Connection(key[0], key[1], timeout=self.connect_timeout)
        try:
            conn.connect()
        except socket.timeout as e:
            raise UpstreamConnectError(f"connect timeout after {self.connect_timeout}s") from e
        except OSError as e:
            raise UpstreamConnectError(str(e)) from e
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sock.settimeout(self.first_byte_timeout)
        return conn

    def send(self, base_url: str, path: str, body: bytes | None, headers: dict[str, str]) -> UpstreamResponse:
        """POST (GET without a body) and return the response with its body unread."""
        key = self._key(base_url)
        method = "POST" if body is not None else "GET"
        conn = self._get(key)
        for reused in (True, False):
            if conn is None:
                reused = False
                conn = self._connect(key)
            try:
                conn.request(method, path, body, headers)
                return UpstreamResponse(self, key, conn, conn.getresponse())
            except socket.timeout as e:
                conn.close()
                raise UpstreamTimeout(str(e)) from e
            except STALE as e:
                conn.close()
                conn = None
                if not reused:
                    raise UpstreamConnectError(f"engine closed the connection: {e!r}") from e
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise UpstreamConnectError(f"{type(e).__name__}: {e}") from e
        raise UpstreamConnectError("unreachable")  # pragma: no cover - the loop always returns or raises


def response_headers(resp: UpstreamResponse, drop: frozenset[str] | None = None) -> list[tuple[str, str]]:
    drop = drop or HOP_BY_HOP
    return [(k, v) for k, v in resp.headers.items() if k.lower() not in drop]


def usage_from_json(body: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from an OpenAI JSON response, if it reports them."""
    if b'"usage"' not in body:
        return None
    try:
        u = json.loads(body).get("usage") or {}
        return int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
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
                 monotonic: Callable[[], float] = time.monotonic):
        self.resp = resp
        self.done = False

        def once(completed: bool, usage) -> None:
            if not self.done:
                self.done = True
                on_done(completed, usage)

        self.on_done = once
        self.gen = stream_body(resp, deadline, on_first, once, monotonic)

    def __iter__(self) -> Iterator[bytes]:
        return self.gen

    def close(self) -> None:
        self.gen.close()  # runs stream_body's finally if it had started
        if not self.done:
            self.resp.close()
            self.on_done(False, None)


def stream_body(resp: UpstreamResponse, deadline: float, on_first: Callable[[], None],
                on_done: Callable[[bool, tuple[int, int] | None], None],
                monotonic: Callable[[], float] = time.monotonic) -> Iterator[bytes]:
    """Yield the engine's bytes as they arrive. `on_done(completed, usage)` runs exactly once, in
    `finally`, after the upstream is released (stream ended) or closed (client gone, error).

    Per chunk only a read, a write (the yield) and a clock check: usage is looked for once, at the
    end, in the last two chunks (the usage event and `[DONE]` may arrive apart)."""
    completed = False
    prev = last = b""
    read1 = resp.read1
    try:
        chunk = read1(65536)
        if chunk:
            on_first()
        while chunk:
            yield chunk
            prev, last = last, chunk
            if monotonic() > deadline:
                log.warning("stream exceeded the total timeout; closing it")
                return
            chunk = read1(65536)
        completed = True
    except (OSError, http.client.HTTPException) as e:
        log.warning("upstream stream broke after the first byte: %s", e)
    finally:
        try:
            if completed:
                resp.release()
            else:
                resp.close()  # drop the connection: the engine sees the client leave and aborts
        finally:
            on_done(completed, sse_usage(prev + last))
