"""Local TCP ports on this machine: can a server listen on one now, the kernel's ephemeral range, and
taking a block of free ports from a range. Shared by the node agent (engine ports), `llmgw up` (its
Redis and its engines' ports) and the test harness. The decisions are `llmgw.proc.portrange`'s."""

from __future__ import annotations

import random
import socket
from typing import Iterable

from llmgw.errors import NoFreePorts
from llmgw.proc.portrange import PortRange, choose_block

EPHEMERAL_PATH = "/proc/sys/net/ipv4/ip_local_port_range"


def can_bind(host: str, port: int) -> bool:
    """True if a server could listen on host:port now. Binds with SO_REUSEADDR, as the engines, Redis
    and gunicorn do: a TIME-WAIT left by an earlier server on the port does not count as taken, but a
    listener does, and so does any socket of an outgoing connection that drew this port as its local
    one (open, or in its 60 s of TIME-WAIT), which refuses every bind, SO_REUSEADDR or not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (bind to port 0): one from its ephemeral range, for a server
    that binds it at once (tests, the engine self-check). What llmgw keeps for itself comes from a
    range outside it (`free_port_range`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_range(path: str = EPHEMERAL_PATH) -> PortRange | None:
    """The kernel's ephemeral port range in this network namespace; None where it cannot be read."""
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return lo, hi


def free_port_range(size: int, port_range: PortRange, host: str = "127.0.0.1", taken: Iterable[int] = (),
                    variable: str = "LLMGW_UP_PORT_RANGE", draw: int | None = None) -> PortRange:
    """A block of `size` consecutive ports of `port_range` that can all be bound now and are not in
    `taken`, searched from a random block on (`draw` fixes it), the blocks outside the kernel's
    ephemeral range first. Raises NoFreePorts, naming `variable`, when there is none."""
    ephemeral = ephemeral_range()
    count = max(1, (port_range[1] - port_range[0] + 1) // max(size, 1))
    start = random.randrange(count) if draw is None else draw
    block = choose_block(port_range, size, taken, lambda p: can_bind(host, p), start=start, avoid=ephemeral)
    if block is None:
        raise NoFreePorts(variable, port_range, size, ephemeral)
    return block
