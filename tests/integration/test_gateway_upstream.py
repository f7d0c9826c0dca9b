"""The gateway's HTTP/1.1 client to engines on a scripted socket server: response heads, chunked
framing however the bytes are split, Content-Length and close-delimited bodies, keep-alive reuse, a
stale pooled connection, and malformed answers."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from gateway.upstream.client import Malformed, Upstream, UpstreamConnectError, UpstreamTimeout
from harness.procs import wait_until


class Scripted:
    """A server that answers each request on a connection with the next script entry: a list of
    byte strings sent one by one (so a test decides how the answer is split), then the connection is
    closed if the list ends with None; an entry None closes the connection without answering."""

    def __init__(self, scripts: list, tls: ssl.SSLContext | None = None):
        self.scripts = list(scripts)
        self.requests: list[bytes] = []
        self.connections = 0
        self.tls = tls
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(8)
        port = self.srv.getsockname()[1]
        self.url = f"https://localhost:{port}" if tls else f"http://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while self.scripts:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.connections += 1
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except (OSError, ssl.SSLError):
                    conn.close()
                    continue
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while self.scripts:
                    req = conn.recv(65536)
                    if not req:
                        break
                    self.requests.append(req)
                    parts = self.scripts.pop(0)
                    if parts is None:
                        break
                    for p in parts:
                        if p is None:
                            break
                        conn.sendall(p)
                    if parts and parts[-1] is None:
                        break

    def close(self):
        self.scripts.clear()
        self.srv.close()
        self.thread.join(5)


@pytest.fixture
def scripted():
    servers = []

    def make(*scripts):
        s = Scripted(list(scripts))
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nX-Request-Id: r\r\n\r\n"
EVENTS = [b"data: {\"a\": 1}\n\n", b"data: {\"b\": 22}\n\n", b"data: [DONE]\n\n"]


def chunked(*payloads: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in payloads) + b"0\r\n\r\n"


def test_head_is_parsed_and_the_request_goes_out_in_one_piece(scripted):
    s = scripted([HEAD, chunked(*EVENTS)])
    up = Upstream(1, 5)
    resp = up.send(s.url, "/v1/chat/completions", b'{"model": "m"}', {"content-type": "application/json",
                                                                     "x-request-id": "r"})
    assert resp.status == 200 and resp.content_type == "text/event-stream" and resp.chunked
    assert ("X-Request-Id", "r") in resp.headers
    assert b"".join(resp.chunks()) == b"".join(EVENTS) and resp.complete
    req = s.requests[0]
    assert req.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"content-type: application/json\r\n" in req and req.endswith(b'\r\n\r\n{"model": "m"}')
    assert b"Content-Length: 14\r\n" in req


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_chunked_framing_split_anywhere(scripted, split):
    """However the engine's bytes are cut into packets, the payload comes out whole and in order,
    and the connection is reused for the next request."""
    raw = HEAD + chunked(*EVENTS)
    pieces = [raw[i:i + split] for i in range(0, len(raw), split)]
    s = scripted(pieces, [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"])
    up = Upstream(1, 5)
    resp = up.send(s.url, "/x", b"{}", {})
    assert b"".join(resp.chunks()) == b"".join(EVENTS)
    resp.release()
    again = up.send(s.url, "/x", b"{}", {})
    assert again.read() == b"ok" and s.connections == 1  # kept alive and reused


def test_several_chunks_in_one_packet_come_out_as_one_piece(scripted):
    s = scripted([HEAD + chunked(*EVENTS)])
    resp = Upstream(1, 5).send(s.url, "/x", b"{}", {})
    assert list(resp.chunks()) == [b"".join(EVENTS)]


def test_content_length_and_close_delimited_bodies(scripted):
    s = scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234", b"56789"],
                 [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil ", b"the end", None])
    up = Upstream(1, 5)
    r1 = up.send(s.url, "/x", b"{}", {})
    assert r1.read() == b"0123456789" and r1.keep_alive
    r1.release()
    r2 = up.send(s.url, "/x", b"{}", {})
    assert not r2.keep_alive
    assert r2.read() == b"until the end"  # the body ends when the engine closes the connection
    r2.release()
    assert not up.idle.get(up._target(s.url).key)  # not reusable: closed, not pooled


def test_a_stale_pooled_connection_is_retried_on_a_fresh_one(scripted):
    s = scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na"], None,
                 [b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nb"])
    up = Upstream(1, 5)
    r = up.send(s.url, "/x", b"{}", {})
    assert r.read() == b"a"
    r.release()
    # the server closes the pooled connection when the next request arrives on it: sent again
    assert up.send(s.url, "/x", b"{}", {}).read() == b"b"
    assert s.connections == 2


def test_refused_and_silent_engines():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}"
    with pytest.raises(UpstreamConnectError):
        Upstream(1, 5).send(url, "/x", b"{}", {})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        with pytest.raises(UpstreamTimeout):
            Upstream(1, 0.2).send(f"http://127.0.0.1:{silent.getsockname()[1]}", "/x", b"{}", {})
    finally:
        silent.close()


def test_malformed_chunk_size_breaks_the_stream(scripted):
    s = scripted([HEAD + b"zz\r\nhello\r\n"])
    resp = Upstream(1, 5).send(s.url, "/x", b"{}", {})
    with pytest.raises(Malformed):
        list(resp.chunks())
    resp.release()  # not complete: closed, never pooled
    assert resp.done and not Upstream(1, 5).idle


def test_https_with_a_path_prefix(tmp_path):
    """An external server over TLS whose url has a path: the handshake checks its certificate, and
    every path goes under the prefix."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    s = Scripted([[ok], [ok]], tls=server_ctx)
    try:
        up = Upstream(2, 5)
        up._tls = ssl.create_default_context(cafile=str(cert))  # trust this test's certificate
        r = up.send(s.url + "/openai", "/v1/responses/resp_1", None, {}, "DELETE")
        assert r.status == 200 and r.read() == b"ok"
        port = s.url.rsplit(":", 1)[1]
        assert s.requests[0].startswith(f"DELETE /openai/v1/responses/resp_1 HTTP/1.1\r\nHost: localhost:{port}\r\n"
                                        .encode())
        with pytest.raises(UpstreamConnectError, match="TLS"):
            Upstream(2, 5).send(s.url, "/v1/models", None, {})  # the system's CAs do not know it
    finally:
        s.close()
class KeepAlive:
    """An engine that answers every request on every connection until `die()` closes them all (its
    process ended: every pooled connection to it is now closed by the peer)."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    def __init__(self):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            while conn.recv(65536):
                conn.sendall(self.ANSWER)
        except OSError:
            pass

    def die(self):
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # the FIN, and the serving thread's recv returns
            except OSError:
                pass
            c.close()
        self.conns.clear()

    def close(self):
        self.die()
        self.srv.close()


def test_connections_an_engine_closed_are_all_dropped_not_only_the_one_taken():
    engine = KeepAlive()
    up = Upstream(1, 2)
    key = up._target(engine.url).key
    try:
        held = [up.send(engine.url, "/x", b"{}", {}) for _ in range(3)]  # three at once: three connections
        for r in held:
            assert r.read() == b"ok"
            r.release()
        assert len(up.idle[key]) == 3
        engine.die()  # an engine restarted on the same port: every pooled connection is half-closed now
        wait_until(lambda: all(c.closed_by_peer() for c in up.idle[key]), 5, what="the FINs to arrive")
        r = up.send(engine.url, "/x", b"{}", {})  # a stale one, then a fresh one
        assert r.read() == b"ok"
        r.release()
        assert len(up.idle[key]) == 1 and not up.idle[key][0].closed_by_peer()
    finally:
        engine.close()


def test_connections_to_engines_that_left_the_list_are_closed():
    a, b = KeepAlive(), KeepAlive()
    up = Upstream(1, 2)
    try:
        for engine in (a, b):
            r = up.send(engine.url, "/x", b"{}", {})
            r.read()
            r.release()
        gone = up.idle[up._target(b.url).key][0]
        up.retain([a.url])
        assert list(up.idle) == [up._target(a.url).key] and gone.sock.fileno() == -1
    finally:
        a.close()
        b.close()
