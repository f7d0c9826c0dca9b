"""Engine ports: picked from LLMGW_PORT_RANGE, never one a record holds or a process listens on.

A port is taken if any replica record on this node names it (whether or not its process is up: a
restart in place keeps its port while it can) or if binding it fails (some other process, or an engine
we no longer track, holds it; or an outgoing connection drew it, when the range overlaps the kernel's
ephemeral range). A restart whose port is taken so starts on another one, which the agent records
(and publishing then routes to). The choice itself is a pure function over those two facts.
"""

from __future__ import annotations

from typing import Callable, Iterable

from llmgw.errors import NoFreePorts


def choose_port(
    port_range: tuple[int, int],
    reserved: Iterable[int],
    bindable: Callable[[int], bool],
    prefer: int | None = None,
) -> int:
    """The port for a new attempt: `prefer` (its previous port) if still free, else the lowest free one.

    `reserved` are ports other records hold; `bindable(port)` checks the machine itself."""
    lo, hi = port_range
    taken = set(reserved)
    if prefer is not None and lo <= prefer <= hi and prefer not in taken and bindable(prefer):
        return prefer
    for port in range(lo, hi + 1):
        if port not in taken and bindable(port):
            return port
    raise NoFreePorts("LLMGW_PORT_RANGE", (lo, hi))
