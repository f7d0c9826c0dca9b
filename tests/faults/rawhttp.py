"""An HTTP client that sends exactly the bytes it is given: the hostile requests of the bad-input and
security tests (tests/faults/test_requests.py, test_security.py), which HTTP libraries refuse or fix
up. Every answer must be complete within a deadline, so a gateway that hangs fails the test instead
of hanging it."""

from __future__ import annotations

import socket
import time
from collections import Counter

DEADLINE = 20.0  # seconds for a whole answer (a sim engine answers in well under one)


def complete(raw: bytes) -> bool:
    """Whether `raw` is a whole request as its head announces it (a body of exactly its
    Content-Length, none without one): a server has nothing more to wait for."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    lengths = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")[1:]
               if line.lower().startswith(b"content-length:")]
    if any(line.lower().startswith(b"transfer-encoding:") for line in head.split(b"\r\n")[1:]):
        return False
    if not lengths:
        return body == b""
    return len(lengths) == 1 and lengths[0].isdigit() and int(lengths[0]) == len(body)


class RawGateway:
    """Requests over raw sockets, each with `Connection: close`, the answer read to the end of the
    connection within DEADLINE."""

    def __init__(self, url: str):
        self.port = int(url.rsplit(":", 1)[1])
        self.statuses: Counter[int] = Counter()  # what the fuzzing got, printed for the record

    def exchange(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        """Send `raw` as it is; the status, headers and body of the answer, read to the end of the
        connection. Fails when no complete answer came within DEADLINE."""
        end = time.monotonic() + DEADLINE
        chunks: list[bytes] = []
        with socket.create_connection(("127.0.0.1", self.port), timeout=DEADLINE) as s:
            try:
                s.sendall(raw)
                # Nothing more is coming: a server waiting for bytes the request announced must answer.
                # Only then: the gateway takes a connection that reached its end (EOF) for a client that
                # left, as nginx does (gateway.request.client), and stops the engine's work for it.
                if not complete(raw):
                    s.shutdown(socket.SHUT_WR)
            except OSError:  # reset, broken pipe, not connected
                pass  # it answered (and closed) before reading everything: read that answer
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no complete answer within {DEADLINE}s to {raw[:200]!r}")
                s.settimeout(left)
                try:
                    b = s.recv(65536)
                except socket.timeout:
                    raise AssertionError(f"no complete answer within {DEADLINE}s to {raw[:200]!r}; "
                                         f"got {b''.join(chunks)[:300]!r}") from None
                except ConnectionResetError:
                    break
                if not b:
                    break
                chunks.append(b)
        data = b"".join(chunks)
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0].startswith(b"HTTP/1."), f"no HTTP answer to {raw[:200]!r}: {data[:300]!r}"
        status = int(lines[0].split()[1])
        self.statuses[status] += 1
        headers = {}
        for line in lines[1:]:
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers, body

    def post(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]] = (),
             length: int | None = None) -> tuple[int, dict[str, str], bytes]:
        """POST `body` to `path` (a path, or an absolute URL as a proxy would get it); a Host and a
        JSON Content-Type unless `headers` has its own; `length`: a Content-Length other than the body's."""
        names = {k.lower() for k, _ in headers}
        head = [b"POST " + path.encode() + b" HTTP/1.1", b"Connection: close"]
        if b"host" not in names:
            head.append(b"Host: 127.0.0.1")
        if b"content-type" not in names:
            head.append(b"Content-Type: application/json")
        head += [k + b": " + v for k, v in headers]
        head.append(b"Content-Length: %d" % (len(body) if length is None else length))
        return self.exchange(b"\r\n".join(head) + b"\r\n\r\n" + body)
