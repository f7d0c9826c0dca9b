"""Forwarding to engines over pooled keep-alive connections.

A small HTTP/1.1 client on plain sockets, with a LIFO pool of keep-alive connections per endpoint:
the request goes out in one write, the response head is split by hand (http.client's `email`-based
header parsing and its layered chunked reader were most of the gateway's per-request CPU), and a
chunked body is passed on piece by piece as it arrives: per piece one receive and, in the caller,
one write (gateway.upstream.stream). Under the gevent worker the sockets are gevent's (patched): a
blocked read yields to the other requests.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from typing import Iterator
from urllib.parse import urlsplit

# Engine response headers not passed on: hop-by-hop ones, those the server sets itself, and
# X-Request-Id (the gateway sends its own, once; an engine that echoes it would make it two).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "content-length", "content-encoding", "server", "date", "x-request-id",
})
# ... and for a stream also its caching headers: the gateway sets its own (gateway.http.answer).
STREAM_REPLACED = HOP_BY_HOP | {"cache-control", "x-accel-buffering"}
MAX_HEAD = 65536  # a response head larger than this is not an engine's
READ = 65536


class UpstreamConnectError(Exception):
    """Nothing reached the engine (refused, unreachable, connect timeout): safe to retry elsewhere."""


class UpstreamTimeout(Exception):
    """The engine accepted the request but sent no first byte in time."""


class Stale(ConnectionError):
    """A reused keep-alive connection was closed by the engine before it answered: the request is
    sent again on a fresh connection (the engine read nothing)."""


class Malformed(ConnectionError):
    """The engine's bytes are not HTTP/1.1 as we understand it."""


class Conn:
    """One keep-alive connection to an engine."""

    __slots__ = ("sock", "buf")

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""  # bytes read past the last response (none, normally)

    def close(self) -> None:
        self.sock.close()

    def closed_by_peer(self) -> bool:
        """An idle keep-alive connection is readable only when the engine closed it (or sent bytes no
        request asked for): either way it is of no more use. Never blocks."""
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True


def parse_head(head: bytes) -> tuple[int, list[tuple[str, str]]]:
    """Status and headers of a response head (without its blank line)."""
    lines = head.split(b"\r\n")
    first = lines[0]
    if not first.startswith(b"HTTP/1.") or len(first) < 12:
        raise Malformed(f"not an HTTP/1.x status line: {first[:80]!r}")
    try:
        status = int(first[9:12])
    except ValueError:
        raise Malformed(f"bad status line: {first[:80]!r}") from None
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise Malformed(f"bad header line: {line[:80]!r}")
        headers.append((name.decode("latin-1"), value.strip().decode("latin-1")))
    return status, headers


class UpstreamResponse:
    """An engine's answer with its body unread, and the connection it came on."""

    __slots__ = ("upstream", "key", "conn", "status", "headers", "content_type", "length", "chunked",
                 "keep_alive", "done", "complete", "idle")

    def __init__(self, upstream: "Upstream", key: tuple[str, int], conn: Conn, status: int,
                 headers: list[tuple[str, str]], bodiless: bool):
        self.upstream, self.key, self.conn, self.status, self.headers = upstream, key, conn, status, headers
        self.content_type, self.length, self.chunked, self.keep_alive = "", None, False, True
        for name, value in headers:
            n = name.lower()
            if n == "content-type":
                self.content_type = value
            elif n == "content-length":
                try:
                    self.length = int(value)
                except ValueError:
                    raise Malformed(f"bad Content-Length {value!r}") from None
            elif n == "transfer-encoding":
                self.chunked = value.lower().endswith("chunked")
            elif n == "connection":
                self.keep_alive = "close" not in value.lower()
        if bodiless:
            self.length, self.chunked = 0, False
        elif self.length is None and not self.chunked:
            self.keep_alive = False  # the body ends when the engine closes the connection
        self.done = False  # released or closed: later calls do nothing (the conn may be reused)
        self.complete = False  # the whole body was read
        self.idle: float | None = None  # the longest silence allowed between pieces, when set

    def _recv(self) -> bytes:
        data = self.conn.sock.recv(READ)
        if not data and (self.chunked or self.length is not None):
            raise ConnectionResetError("the engine closed the connection mid-answer")
        return data

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives: each piece is what one receive completed (a chunked body's
        framing removed; the pieces of several chunks that arrived together are joined)."""
        conn = self.conn
        if not self.chunked:
            left = self.length
            buf, conn.buf = conn.buf, b""
            while left is None or left > 0:
                if not buf:
                    buf = self._recv()
                    if not buf:  # close-delimited body: the end
                        break
                if left is not None:
                    if len(buf) > left:
                        raise Malformed("the engine sent more than its Content-Length")
                    left -= len(buf)
                yield buf
                buf = b""
            self.complete = True
            return
        buf, conn.buf = conn.buf, b""
        recv = self._recv
        while True:
            parts = []
            while True:  # every complete chunk in the buffer
                nl = buf.find(b"\r\n")
                if nl < 0:
                    break
                try:
                    size = int(buf[:nl].split(b";", 1)[0], 16)
                except ValueError:
                    raise Malformed(f"bad chunk size line {buf[:nl][:40]!r}") from None
                if size == 0:  # the last chunk; then trailers (none, from engines) and a blank line
                    end = buf.find(b"\r\n\r\n", nl)
                    if end < 0:
                        break
                    if parts:
                        yield parts[0] if len(parts) == 1 else b"".join(parts)
                    conn.buf = buf[end + 4:]
                    self.complete = True
                    return
                end = nl + 2 + size
                if len(buf) < end + 2:
                    break
                parts.append(buf[nl + 2:end])
                buf = buf[end + 2:]
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
            if len(buf) > MAX_HEAD + READ:
                raise Malformed("chunk framing out of bounds")
            data = recv()
            buf = buf + data if buf else data

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def idle_timeout(self, seconds: float) -> None:
        """From now a read waits at most `seconds` for the next piece (socket.timeout after that):
        once tokens flow, a longer silence is a stalled engine. A connection given back to the pool
        gets the first-byte timeout again."""
        self.idle = seconds
        self.conn.sock.settimeout(seconds)

    def release(self) -> None:
        """Body fully read: the connection goes back to the pool (unless the engine closes it)."""
        if self.done:
            return
        if not (self.complete and self.keep_alive) or self.conn.buf:
            self.close()
        else:
            self.done = True
            if self.idle is not None:
                self.conn.sock.settimeout(self.upstream.first_byte_timeout)
            self.upstream._put(self.key, self.conn)

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.conn.close()

    def shutdown(self) -> None:
        """End the connection now, from anywhere (another greenlet, gevent's loop): a read waiting on
        it returns, and the engine sees its client leave. `close` still follows, by the reader."""
        if not self.done:
            try:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the engine


class Target:
    """Where an endpoint's url points: the pool key (host, port, TLS), the Host header, and the path
    prefix its paths go under (an external server's url may have one)."""

    __slots__ = ("key", "host", "prefix")

    def __init__(self, base_url: str):
        u = urlsplit(base_url)
        tls = u.scheme == "https"
        host = u.hostname or "127.0.0.1"
        port = u.port or (443 if tls else 80)
        self.key = (host, port, tls)
        self.host = host if u.port is None else f"{host}:{port}"
        self.prefix = u.path.rstrip("/")


def _ip_family(host: str) -> int | None:
    """AF_INET or AF_INET6 when `host` is an address literal (an engine's usual url), else None."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return family
        except OSError:
            continue
    return None


def _connect_ip(family: int, host: str, port: int, timeout: float) -> socket.socket:
    """A connection to an address literal without `getaddrinfo`: under gevent every getaddrinfo goes
    through its resolver's thread pool, even for "127.0.0.1", and each call waits there for the GIL
    behind the busy event loop. At thousands of new connections that queue took seconds per connect,
    the whole of the gateway's time-to-first-byte tail (`python -m bench.streams --levels 4096`)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class Upstream:
    def __init__(self, connect_timeout: float, first_byte_timeout: float, pool_size: int = 256):
        self.connect_timeout, self.first_byte_timeout = connect_timeout, first_byte_timeout
        self.pool_size = pool_size
        self.idle: dict[tuple[str, int, bool], list[Conn]] = {}
        self.lock = threading.Lock()
        self.targets: dict[str, Target] = {}
        self._tls: ssl.SSLContext | None = None  # made on first use: the system's CAs (SSL_CERT_FILE)

    def _target(self, base_url: str) -> Target:
        t = self.targets.get(base_url)
        if t is None:
            t = self.targets[base_url] = Target(base_url)
        return t

    def _get(self, key: tuple[str, int, bool]) -> Conn | None:
        with self.lock:
            conns = self.idle.get(key)
            return conns.pop() if conns else None

    def _put(self, key: tuple[str, int, bool], conn: Conn) -> None:
        with self.lock:
            conns = self.idle.setdefault(key, [])
            if len(conns) < self.pool_size:
                conns.append(conn)
                return
        conn.close()

    def _sweep(self, key: tuple[str, int, bool]) -> None:
        """A pooled connection to `key` turned out closed by its engine (it restarted, or went away):
        close every idle one it closed too, not only those requests happen to take. A LIFO pool would
        otherwise keep the ones at its bottom half-closed (CLOSE_WAIT), holding descriptors, for good."""
        with self.lock:
            conns = self.idle.get(key, [])
            dead = [c for c in conns if c.closed_by_peer()]
            if dead:
                self.idle[key] = [c for c in conns if c not in dead]
        for c in dead:
            c.close()

    def retain(self, base_urls) -> None:
        """Close the idle connections to engines no longer in the endpoint list (stopped or moved)."""
        keep = {self._target(u).key for u in base_urls}
        with self.lock:
            gone = [k for k in self.idle if k not in keep]
            dropped = [c for k in gone for c in self.idle.pop(k)]
            self.targets = {u: t for u, t in self.targets.items() if t.key in keep}
        for c in dropped:
            c.close()

    def _connect(self, key: tuple[str, int, bool]) -> Conn:
        host, port, tls = key
        try:
            family = _ip_family(host)
            if family is None:  # a name (an external server): resolved on each new connection
                sock = socket.create_connection((host, port), timeout=self.connect_timeout)
            else:
                sock = _connect_ip(family, host, port, self.connect_timeout)
        except socket.timeout as e:
            raise UpstreamConnectError(f"connect timeout after {self.connect_timeout}s") from e
        except OSError as e:
            raise UpstreamConnectError(str(e)) from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls:  # an external server over https; the handshake counts against the connect timeout
            if self._tls is None:
                self._tls = ssl.create_default_context()
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=host)
            except (OSError, ssl.SSLError) as e:
                sock.close()
                raise UpstreamConnectError(f"TLS with {host}:{port} failed: {e}") from e
        sock.settimeout(self.first_byte_timeout)
        return Conn(sock)

    def _exchange(self, conn: Conn, key: tuple[str, int, bool], request: bytes, bodiless: bool) -> UpstreamResponse:
        """Send the request in one write; read until the response head is complete."""
        sock = conn.sock
        sock.sendall(request)
        buf = conn.buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                status, headers = parse_head(buf[:end])
                if 100 <= status < 200:  # informational (100 Continue): the answer follows
                    buf = buf[end + 4:]
                    continue
                conn.buf = buf[end + 4:]
                return UpstreamResponse(self, key, conn, status, headers, bodiless or status in (204, 304))
            if len(buf) > MAX_HEAD:
                raise Malformed("response head too large")
            data = sock.recv(READ)
            if not data:
                raise Stale("the engine closed the connection before answering")
            buf += data

    def send(self, base_url: str, path: str, body: bytes | None, headers: dict[str, str],
             method: str | None = None, watch=None) -> UpstreamResponse:
        """Send the request (POST, or GET without a body, unless `method` says) and return the
        response with its body unread. `watch` (the client's gateway.request.client.ClientConn): while
        the engine's head is awaited, a client that leaves shuts the engine's connection, so an engine
        that answers a non-streamed request only once it is complete (vLLM) sees its client go and
        stops generating; the caller then finds `watch.gone()`."""
        target = self._target(base_url)
        key = target.key
        method = method or ("POST" if body is not None else "GET")
        head = [f"{method} {target.prefix}{path} HTTP/1.1\r\nHost: {target.host}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in headers.items()]
        if body is not None or method == "POST":  # a bodiless POST (a cancel) says so
            head.append(f"Content-Length: {len(body or b'')}\r\n")
        head.append("\r\n")
        request = "".join(head).encode("latin-1") + (body or b"")
        conn = self._get(key)
        for reused in (True, False):
            if conn is None:
                reused = False
                conn = self._connect(key)
            unwatch = _shut_when_gone(watch, conn) if watch is not None else None
            try:
                return self._exchange(conn, key, request, False)
            except socket.timeout as e:
                conn.close()
                raise UpstreamTimeout(str(e)) from e
            except (Stale, ConnectionResetError, BrokenPipeError) as e:
                conn.close()
                conn = None
                if not reused:
                    raise UpstreamConnectError(f"engine closed the connection: {e!r}") from e
                self._sweep(key)
            except OSError as e:
                conn.close()
                raise UpstreamConnectError(f"{type(e).__name__}: {e}") from e
            finally:
                if unwatch is not None:
                    unwatch()
        raise UpstreamConnectError("unreachable")  # pragma: no cover - the loop always returns or raises


def _shut_when_gone(client, conn):
    """Under gevent: shut `conn` once `client` has left (its socket turned readable at EOF). Returns
    what stops watching, or None where the client cannot be watched."""

    def left() -> None:
        if client.gone():
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    return client.when_readable(left)


def response_headers(resp: UpstreamResponse, drop: frozenset[str] | None = None) -> list[tuple[str, str]]:
    """The engine's headers the client gets: not those in `drop`, nor an empty one (llama-server sends
    `Access-Control-Allow-Origin:` with no value to a request without an Origin; it says nothing)."""
    drop = drop or HOP_BY_HOP
    return [(k, v) for k, v in resp.headers if v and k.lower() not in drop]
