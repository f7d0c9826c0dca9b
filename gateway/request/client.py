"""Whether the client of a request is still there, read from its socket without reading its bytes.

A client that closed its connection makes the socket readable with nothing to read (EOF); a peek
that does not wait (`MSG_PEEK | MSG_DONTWAIT`) tells that apart from a request pipelined behind this
one (bytes to read: still there) and from a quiet client (would block: still there). One system
call, no buffering, nothing consumed: gunicorn still reads the next request itself.

Used where the gateway would otherwise learn of the departure only by writing to it: while a request
waits in the queue (the queue's waiter is woken when the socket turns readable, under gevent), and
while a non-streamed answer is assembled from an engine's stream (checked between its pieces). A
stream relayed to the client learns of it from the failed write.

The socket is gunicorn's (`gunicorn.socket`); anything else (the test client, another server) has
none, and the client is then taken to be there.
"""

from __future__ import annotations

import logging
import socket
from typing import Callable

log = logging.getLogger("llmgw.gateway")

PEEK = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)


class ClientConn:
    """The client's end of one request."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket | None):
        # Under gevent the raw non-blocking socket beneath gevent's: its recv never waits.
        self.sock = getattr(sock, "_sock", sock) if sock is not None else None

    def gone(self) -> bool:
        """The client closed (or reset) its connection."""
        s = self.sock
        if s is None:
            return False
        try:
            return s.recv(1, PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: a client waiting for its answer
        except OSError:
            return True  # reset, or the socket is already closed

    def when_readable(self, wake: Callable[[], None]) -> Callable[[], None] | None:
        """Under gevent: call `wake()` (from the event loop) once the socket turns readable, which is
        when a client leaves. Returns what cancels that, or None where it cannot be watched (then
        the caller checks `gone()` when it wakes for other reasons)."""
        if self.sock is None:
            return None
        try:
            from gevent import get_hub
            from gevent.monkey import is_module_patched
        except ImportError:  # pragma: no cover - gevent is a dependency
            return None
        if not is_module_patched("socket"):
            return None
        try:
            watcher = get_hub().loop.io(self.sock.fileno(), 1)  # 1: READ
        except (OSError, ValueError):
            return None

        def fired() -> None:
            watcher.stop()  # level-triggered: once is enough (a pipelined request would fire it forever)
            wake()

        watcher.start(fired)
        return watcher.close


def client_of(environ: dict) -> ClientConn:
    return ClientConn(environ.get("gunicorn.socket"))


NO_CLIENT = ClientConn(None)  # a request without a socket to watch (the test client, a simulator)
