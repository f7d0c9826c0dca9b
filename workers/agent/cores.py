"""CPU cores for a CPU replica of vLLM (`device: cpu`): which of the node's cores its threads bind to.

A replica gets `threads` cores of the ones this agent may use (its CPU affinity), the least held by
the other records on this node (ties: the lowest), so two replicas on one machine bind to different
cores while there are enough, and share the least loaded ones when there are not. A restart keeps its
previous cores while no other record took them. Like ports, the choice is a pure function over what
the records hold; the record keeps the choice (`ReplicaRecord.cpus`), so an agent restarted later
still knows which cores are taken.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence


def choose_cores(available: Sequence[int], want: int, held: Iterable[Iterable[int]],
                 prefer: Sequence[int] = ()) -> tuple[int, ...]:
    """`want` cores of `available` (sorted, distinct while there are that many): `prefer` (the
    replica's previous cores) when all are available and held by no one else, else the least held.
    `held`: the cores each other record on this node holds."""
    cores = sorted(set(available))
    if not cores or want < 1:
        return ()
    load = Counter(c for h in held for c in h)
    if prefer and len(set(prefer)) == min(want, len(cores)) and all(c in cores and not load[c] for c in prefer):
        return tuple(sorted(set(prefer)))
    order = sorted(cores, key=lambda c: (load[c], c))
    return tuple(sorted(order[:min(want, len(cores))]))
