"""Local TCP ports: can a server listen on one now, and pick free ones. Shared by the node agent
(engine ports), `llmgw up` (its Redis and gateway ports) and the test harness."""

from __future__ import annotations

import socket


def can_bind(host: str, port: int) -> bool:
    """True if a server could listen on host:port now (SO_REUSEADDR, like the engines use, so a
    socket in TIME_WAIT does not count as taken, but a listening one does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (bind to port 0). Another process may take it before the
    caller binds it: fine for tests and `llmgw up`, which fail clearly if it does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_range(size: int = 50, host: str = "127.0.0.1", tries: int = 200) -> tuple[int, int]:
    """A block of `size` consecutive ports none of which can be refused now (an agent's port range)."""
    for _ in range(tries):
        start = free_port(host)
        if start + size >= 65000:
            continue
        if all(can_bind(host, p) for p in range(start, start + size)):
            return start, start + size - 1
    raise RuntimeError(f"no range of {size} free ports found")
