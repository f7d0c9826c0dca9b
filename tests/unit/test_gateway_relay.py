"""gateway.upstream.relay: a stream written to the client's socket directly, and the server told so; when it
applies, what goes on the wire, and how the connection ends."""

from __future__ import annotations

import pytest

from gateway.http.answer import RawAnswer
from gateway.upstream.relay import ALREADY_HANDLED, LAST_CHUNK, Closing, chunk_writer, relay, relay_target


class RawSock:
    """The non-blocking socket under gevent's: takes at most `room` bytes per send."""

    def __init__(self, room: int | None = None, fail: Exception | None = None):
        self.room, self.fail, self.wire = room, fail, bytearray()

    def send(self, data) -> int:
        if self.fail is not None:
            raise self.fail
        n = len(data) if self.room is None else min(self.room, len(data))
        self.wire += bytes(data[:n])
        return n


class GeventSock:
    def __init__(self, raw: RawSock):
        self._sock = raw
        self.waited = 0  # sendall calls: each one would have waited for the client's window

    def sendall(self, data) -> None:
        self.waited += 1
        self._sock.wire += bytes(data)


class GunicornResponse:
    """What relay uses of gunicorn.http.wsgi.Response."""

    def __init__(self, sock, chunked: bool = True, close: bool = False, refuse: bool = False):
        self.sock, self.chunked, self.close, self.refuse = sock, chunked, close, refuse
        self.status = None

    def start_response(self, status, headers, exc_info=None):
        if self.refuse:
            raise ValueError("invalid header")
        self.status, self.headers = status, headers

    def send_headers(self):
        self.sock.sendall(b"HEAD\r\n\r\n")

    def should_close(self) -> bool:
        return self.close


class Body:
    """A StreamBody stand-in: its pieces, whether they were all passed on, and its close."""

    def __init__(self, pieces: list[bytes], completes: bool = True):
        self.pieces, self.completes = pieces, completes
        self.completed, self.closed = False, 0

    def __iter__(self):
        yield from self.pieces
        self.completed = self.completes

    def close(self):
        self.closed += 1


def environ(sock, scheme="http", protocol="HTTP/1.1") -> dict:
    return {"wsgi.url_scheme": scheme, "SERVER_PROTOCOL": protocol, "gunicorn.socket": sock}


def test_a_stream_goes_to_the_socket_only_under_gunicorns_gevent_worker_over_plain_http11():
    sock = GeventSock(RawSock())
    gresp = GunicornResponse(sock)
    assert relay_target(environ(sock), gresp.start_response) is gresp
    assert relay_target(environ(sock, scheme="https"), gresp.start_response) is None  # TLS: gunicorn writes
    assert relay_target(environ(sock, protocol="HTTP/1.0"), gresp.start_response) is None  # no chunks
    assert relay_target(environ(sock), lambda status, headers: None) is None  # another server, the test client
    other = GeventSock(RawSock())
    assert relay_target(environ(other), gresp.start_response) is None  # not this request's socket
    plain = GunicornResponse(object())  # a socket with no raw one beneath (not gevent's)
    assert relay_target(environ(plain.sock), plain.start_response) is None


def test_each_piece_is_one_chunk_and_a_full_window_waits_through_gevent():
    raw = RawSock(room=5)
    sock = GeventSock(raw)
    write = chunk_writer(sock)
    write(b"data: hello\n\n")
    assert bytes(raw.wire) == b"d\r\ndata: hello\n\n\r\n"
    assert sock.waited == 1  # the first 5 bytes went out at once, the rest through gevent's sendall
    full = RawSock(fail=BlockingIOError())
    sock = GeventSock(full)
    chunk_writer(sock)(b"x")
    assert bytes(full.wire) == b"1\r\nx\r\n" and sock.waited == 1


def test_a_completed_stream_ends_with_the_last_chunk_and_keeps_the_connection():
    sock = GeventSock(RawSock())
    gresp = GunicornResponse(sock)
    body = Body([b"data: a\n\n", b"", b"data: [DONE]\n\n"])
    answer = RawAnswer(200, [("Content-Type", "text/event-stream")], body)
    assert relay(answer, gresp, gresp.start_response) is ALREADY_HANDLED
    assert gresp.status == "200 OK"
    assert bytes(sock._sock.wire) == (b"HEAD\r\n\r\n" + b"9\r\ndata: a\n\n\r\n" + b"e\r\ndata: [DONE]\n\n\r\n"
                                      + LAST_CHUNK)
    assert body.closed == 1


def test_a_stream_cut_short_closes_the_connection_without_the_last_chunk():
    sock = GeventSock(RawSock())
    gresp = GunicornResponse(sock)
    body = Body([b"data: a\n\n"], completes=False)
    with pytest.raises(Closing):  # gunicorn closes the connection on StopIteration
        relay(RawAnswer(200, [], body), gresp, gresp.start_response)
    assert not bytes(sock._sock.wire).endswith(LAST_CHUNK) and body.closed == 1


def test_a_connection_the_client_or_a_shutdown_closes_ends_after_the_whole_stream():
    sock = GeventSock(RawSock())
    gresp = GunicornResponse(sock, close=True)
    body = Body([b"data: a\n\n"])
    with pytest.raises(Closing):
        relay(RawAnswer(200, [], body), gresp, gresp.start_response)
    assert bytes(sock._sock.wire).endswith(LAST_CHUNK) and body.closed == 1


def test_a_client_gone_mid_stream_closes_the_body_and_the_error_reaches_the_server():
    sock = GeventSock(RawSock(fail=BrokenPipeError()))
    sock.sendall = lambda data: (_ for _ in ()).throw(BrokenPipeError())  # headers cannot go either
    gresp = GunicornResponse(sock)
    gresp.send_headers = lambda: None
    body = Body([b"data: a\n\n", b"data: b\n\n"])
    with pytest.raises(BrokenPipeError):
        relay(RawAnswer(200, [], body), gresp, gresp.start_response)
    assert body.closed == 1  # the upstream is closed and the slot given back


def test_a_head_the_server_refuses_closes_the_body_once():
    sock = GeventSock(RawSock())
    gresp = GunicornResponse(sock, refuse=True)
    body = Body([b"data: a\n\n"])
    with pytest.raises(ValueError):
        relay(RawAnswer(200, [("Bad", "x\r\ny")], body), gresp, gresp.start_response)
    assert body.closed == 1 and not sock._sock.wire


def test_without_chunked_framing_the_server_writes_the_body():
    sock = GeventSock(RawSock())
    gresp = GunicornResponse(sock, chunked=False)
    body = Body([b"data: a\n\n"])
    assert relay(RawAnswer(200, [], body), gresp, gresp.start_response) is body
    assert body.closed == 0 and not sock._sock.wire  # gunicorn iterates and closes it
