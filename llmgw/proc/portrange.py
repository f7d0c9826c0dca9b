"""Port ranges, decided without touching the machine: which block of a range to take, and what to say
when a range overlaps the kernel's ephemeral range.

Every outgoing TCP connection draws its local port from the ephemeral range
(`net.ipv4.ip_local_port_range`, 32768-60999 by default), and a port so drawn refuses a server's bind,
SO_REUSEADDR or not, while the connection is open and for the 60 s it then spends in TIME-WAIT. On a
host that has just made thousands of connections, a good share of that range refuses a bind; below it,
only listeners (and explicitly bound sockets) do. So the ports llmgw takes for itself and its engines
come from a range outside it (`LLMGW_UP_PORT_RANGE`, `LLMGW_PORT_RANGE`). The shells (`llmgw.proc.ports`,
`llmgw up`, the node agent) read the kernel's range and probe ports; these functions only decide.
"""

from __future__ import annotations

from typing import Callable, Iterable

EPHEMERAL_SETTING = "net.ipv4.ip_local_port_range"

PortRange = tuple[int, int]


def overlap(a: PortRange, b: PortRange | None) -> int:
    """How many ports ranges `a` and `b` share (0 when `b` is None: the kernel's range is unknown)."""
    if b is None:
        return 0
    return max(0, min(a[1], b[1]) - max(a[0], b[0]) + 1)


def ephemeral_warning(variable: str, port_range: PortRange, ephemeral: PortRange | None) -> str | None:
    """One line saying that `variable`'s range overlaps the kernel's ephemeral range and what to set;
    None when it does not."""
    shared = overlap(port_range, ephemeral)
    if not shared or ephemeral is None:
        return None
    lo, hi = port_range
    elo, ehi = ephemeral
    return (f"{variable} {lo}-{hi} overlaps the kernel's ephemeral port range {elo}-{ehi} ({EPHEMERAL_SETTING}) "
            f"by {shared} ports: outgoing connections draw their local ports there, and such a port refuses a "
            f"bind; set {variable}=START-END outside {elo}-{ehi}")


def choose_block(
    port_range: PortRange,
    size: int,
    taken: Iterable[int],
    bindable: Callable[[int], bool],
    start: int = 0,
    avoid: PortRange | None = None,
) -> PortRange | None:
    """The block of `size` consecutive ports to take from `port_range`, or None when no block is free.

    Blocks are aligned on the range's first port. The search begins at block `start` (taken modulo
    their number: the caller's random draw, so that two `llmgw up` starting at once rarely probe the
    same block first) and tries the blocks that share no port with `avoid` (the kernel's ephemeral
    range) before those that do. A block is free when none of its ports is in `taken` (ports the caller
    knows are held) and `bindable(port)` (the probe of the machine) holds for each."""
    lo, hi = port_range
    if size < 1:
        raise ValueError(f"a block has at least one port, not {size}")
    count = (hi - lo + 1) // size
    if count == 0:
        return None
    held = set(taken)
    order = [(lo + ((start + i) % count) * size) for i in range(count)]
    order.sort(key=lambda first: overlap((first, first + size - 1), avoid) > 0)  # stable: keeps the rotation
    for first in order:
        ports = range(first, first + size)
        if not held.intersection(ports) and all(bindable(p) for p in ports):
            return first, first + size - 1
    return None
