"""Multi-node for the simulated engine: a tiny TCP rendezvous standing in for torch.distributed.

The head (`--node-rank 0`, with `--nnodes N > 1`) listens on `--master-port` and is not ready (its
/health answers 503) until every member rank 1..N-1 is connected, as a real multi-node engine is not
ready until its workers join. A headless member connects to `--master-addr:--master-port`, sends
`join <rank>`, and then lives exactly as long as that connection: it exits 1 when it cannot join
within `--join-timeout` seconds or when the head's connection drops (the head crashed or stopped),
which is what the node agent must notice and restart.

Protocol (one line each way): member -> `join <rank>\\n`; head -> `ok\\n` or `error <why>\\n`.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

JOIN_POLL = 0.2  # seconds between connection attempts while the head is not listening yet


class Rendezvous:
    """The head's side: accepts one connection per member rank; a rank that reconnects replaces its
    old connection (the newest part of a rank is the current one), a rank that leaves makes the head
    not ready again until it rejoins."""

    def __init__(self, host: str, port: int, nnodes: int, log: Callable[[str], None]):
        self.nnodes = nnodes
        self._log = log
        self._lock = threading.Lock()
        self._members: dict[int, socket.socket] = {}
        self._closing = False
        self._sock = socket.create_server((host, port), backlog=16)  # OSError if the port is taken
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, name="sim-rendezvous", daemon=True).start()

    def ready(self) -> bool:
        with self._lock:
            return len(self._members) == self.nnodes - 1

    def waiting_for(self) -> list[int]:
        with self._lock:
            return [r for r in range(1, self.nnodes) if r not in self._members]

    def close(self) -> None:
        with self._lock:
            self._closing = True
            conns = list(self._members.values())
            self._members.clear()
        for s in [self._sock, *conns]:
            _close(s)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="sim-member", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            line = conn.makefile("rb").readline(64).decode("ascii", "replace").split()
        except OSError:
            _close(conn)
            return
        rank = int(line[1]) if len(line) == 2 and line[0] == "join" and line[1].isdigit() else None
        if rank is None or not 1 <= rank < self.nnodes:
            _reply(conn, f"error bad join {' '.join(line)!r}: expected 'join <rank>' with rank 1..{self.nnodes - 1}")
            _close(conn)
            return
        with self._lock:
            if self._closing:
                _close(conn)
                return
            old = self._members.get(rank)
            self._members[rank] = conn
            joined = len(self._members)
        if old is not None:
            self._log(f"rank {rank} joined again: dropping its previous connection")
            _close(old)
        _reply(conn, "ok")
        self._log(f"rank {rank} joined ({joined} of {self.nnodes - 1} members)")
        conn.settimeout(None)
        try:
            while conn.recv(64):
                pass  # members send nothing after joining; EOF or an error means it left
        except OSError:
            pass
        with self._lock:
            left = self._members.get(rank) is conn
            if left:
                del self._members[rank]
        if left:
            self._log(f"rank {rank} left: not ready until it joins again")
        _close(conn)


def join(addr: str, port: int, rank: int, timeout: float, stop: threading.Event,
         log: Callable[[str], None]) -> int:
    """A headless member's whole life: join the head, then wait until the head goes away (exit 1) or
    this process is asked to stop (`stop` set: exit 0). Returns the exit status."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        if stop.is_set():
            log("stopped before joining")
            return 0
        try:
            sock = socket.create_connection((addr, port), timeout=min(2.0, timeout))
            break
        except OSError as e:
            last_error = e.strerror or str(e)
        if time.monotonic() >= deadline or stop.wait(JOIN_POLL):
            if stop.is_set():
                log("stopped before joining")
                return 0
            log(f"cannot join the head at {addr}:{port} within {timeout:g}s: {last_error}")
            return 1
    try:
        sock.sendall(f"join {rank}\n".encode())
        reply = sock.makefile("rb").readline(256).decode("utf-8", "replace").strip()
    except OSError as e:
        log(f"the head at {addr}:{port} dropped the join: {e.strerror or e}")
        _close(sock)
        return 1
    if reply != "ok":
        log(f"the head at {addr}:{port} refused rank {rank}: {reply or 'connection closed'}")
        _close(sock)
        return 1
    log(f"joined the head at {addr}:{port} as rank {rank}")
    # Poll with a short timeout so SIGTERM (which sets `stop`) is seen promptly.
    sock.settimeout(JOIN_POLL)
    try:
        while not stop.is_set():
            try:
                if not sock.recv(64):
                    log(f"the head at {addr}:{port} closed the connection: exiting")
                    return 1
            except socket.timeout:
                continue
            except OSError as e:
                log(f"lost the head at {addr}:{port}: {e.strerror or e}: exiting")
                return 1
    finally:
        _close(sock)
    log("stopped")
    return 0


def _reply(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall(text.encode() + b"\n")
    except OSError:
        pass


def _close(s: socket.socket) -> None:
    # shutdown() first: it wakes a thread blocked in recv/accept on this socket and sends the peer
    # its EOF at once (a bare close() from another thread does neither on Linux).
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
