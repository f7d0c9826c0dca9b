"""CPU cores for a CPU replica of vLLM (`device: cpu`): which of the node's cores its threads bind to.

A replica gets `threads` cores of the ones this agent may use (its CPU affinity), the least held by
the other records on this node (ties: the fewest held by records being stopped, then the lowest), so
two replicas on one machine bind to different cores while there are enough, and share the least
loaded ones when there are not. A record being stopped still runs until it has drained, but it will
go: a rolling replacement's surge replica shares its core, not the core of the replica that stays and
serves every request meanwhile (on 2 cores, the lowest-number tie could put both compute threads on
the serving core for the new replica's whole life, the other core idle). A restart keeps its
previous cores while no other record took them. Like ports, the choice is a pure function over what
the records hold; the record keeps the choice (`ReplicaRecord.cpus`), so an agent restarted later
still knows which cores are taken.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence


def choose_cores(available: Sequence[int], want: int, held: Iterable[Iterable[int]],
                 prefer: Sequence[int] = (), leaving: Iterable[Iterable[int]] = ()) -> tuple[int, ...]:
    """`want` cores of `available` (sorted, distinct while there are that many): `prefer` (the
    replica's previous cores) when all are available and held by no one else, else the least held.
    `held`: the cores each other record on this node holds that stays; `leaving`: the cores of each
    record whose stop was asked for (they count after `held`, before the core's number)."""
    cores = sorted(set(available))
    if not cores or want < 1:
        return ()
    load = Counter(c for h in held for c in h)
    going = Counter(c for h in leaving for c in h)
    if prefer and len(set(prefer)) == min(want, len(cores)) and all(
            c in cores and not load[c] and not going[c] for c in prefer):
        return tuple(sorted(set(prefer)))
    order = sorted(cores, key=lambda c: (load[c], going[c], c))
    return tuple(sorted(order[:min(want, len(cores))]))


def launch_cores(available: Sequence[int], chosen: Sequence[int], held: Iterable[Iterable[int]],
                 leaving: Iterable[Iterable[int]] = ()) -> tuple[int, ...]:
    """The cores a CPU replica's processes may run on: its `chosen` ones (where its compute threads
    bind) and those of `available` that no other record holds, staying or leaving.

    Why not all of the agent's: at import, torch's MKL counts the cores by moving its thread onto each
    allowed core in turn. Moved onto a core where another replica's compute thread spins, that thread
    waited minutes to run here (a 2-core Firecracker VM, kernel 6.18), so a rolling replacement's
    surge replica took 5-10 min to start instead of 40 s. Why not only its chosen ones: vLLM's API
    server and scheduler process then share the compute thread's core while a core nobody uses sits
    idle. Empty when nothing was chosen (a replica that binds no cores)."""
    if not chosen:
        return ()
    taken = {c for h in held for c in h} | {c for h in leaving for c in h}
    return tuple(sorted(set(chosen) | (set(available) - taken)))
