"""What the housekeeping pass tidies, decided over one `HousekeepingView`: the load samples of deleted
replicas (external urls keep theirs), the per-node replica index (rebuilt from every record, which
also indexes records written before the index existed), and nodes gone for `forget_after` seconds
that nothing refers to any more (no replica record, no operator flag). Pure: the shell is
`workers/control/housekeeping_pass.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Mapping

from llmgw.state.records import ReplicaRecord
from llmgw.state.views import HousekeepingView

FORGET_AFTER = 600.0  # seconds a node is missing before housekeeping may forget it


@dataclass(frozen=True)
class Forget:
    """Housekeeping's decision about nodes without a heartbeat."""

    first_missing: Mapping[str, float] = field(default_factory=dict)  # start their clock now
    back: tuple[str, ...] = ()  # heartbeating again: clear their clock
    gone: tuple[str, ...] = ()  # forget them


def forget(
    nodes: Mapping[str, bool],
    missing_since: Mapping[str, float],
    referenced: AbstractSet[str],
    now: float,
    forget_after: float = FORGET_AFTER,
) -> Forget:
    """Which nodes to forget. `nodes`: every known node -> live; `missing_since`: when a node was
    first seen without a heartbeat; `referenced`: nodes a replica record or an operator flag names.
    A node is forgotten once it has been missing `forget_after` seconds and nothing refers to it, so
    `llmgw status` keeps showing a recently gone node and one that still matters."""
    first: dict[str, float] = {}
    gone: list[str] = []
    for name in sorted(nodes):
        if nodes[name]:
            continue
        since = missing_since.get(name)
        if since is None:
            first[name] = now
        elif now - since >= forget_after and name not in referenced:
            gone.append(name)
    back = tuple(sorted(n for n in missing_since if nodes.get(n)))
    return Forget(first_missing=first, back=back, gone=tuple(gone))


@dataclass(frozen=True)
class Tidy:
    """What one housekeeping pass writes (`Store.write_housekeeping`)."""

    keep_loads: tuple[str, ...]  # the replicas and external urls whose load samples stay
    index: tuple[ReplicaRecord, ...]  # every record: the per-node index is made to agree with them
    nodes: Forget


def decide(view: HousekeepingView, now: float, forget_after: float = FORGET_AFTER) -> Tidy:
    """What to tidy, over what the pass read."""
    referenced = {n for r in view.replicas for n in r.all_nodes}
    referenced |= {n for n, a in view.admin.items() if a.cordoned or a.draining}
    nodes = forget({n: n in view.live for n in view.known}, view.missing_since, referenced, now, forget_after)
    keep = (*(r.id for r in view.replicas), *(x.id for x in view.externals))
    return Tidy(keep_loads=keep, index=view.replicas, nodes=nodes)
