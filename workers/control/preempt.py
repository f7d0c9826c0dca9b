"""GPU sharing by `scheduling_priority`: which replicas to drain so a waiting one fits. Pure.

When a GPU replica cannot be placed, `choose_victims(request, priority, view, holders, budget)` looks
at every node the request could use and what would make room there, cheapest first:

1. GPUs already coming free: replicas on the node that were asked to stop (drained by a scale-down,
   an update, an earlier preemption) count as free once they are gone, so a pass never preempts more
   while its victims drain;
2. then replicas of profiles with a strictly lower `scheduling_priority` (lowest first, then least
   loaded), never taking a profile below its `min` (`budget`: how many each profile can lose; a
   fixed `replicas: N` profile can lose none).

It picks the node(s) that need the fewest new victims (then the lowest priorities, the least load),
and answers the victims to stop and the replicas the request now waits for; or None when nothing
would make room. `Preemptor` keeps what one planning pass has promised: GPUs a waiting request
counts on are not counted again by the next one, and the free GPUs it counts on are reserved in the
view so a lower-priority replica is not placed on them in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from llmgw.gpus import normalize_gpu_class
from workers.control.placement import ClusterView, Placement, PlacementRequest

# How many replicas a reason names before "and N more".
_REASON_REPLICAS = 4


@dataclass(frozen=True)
class Holder:
    """A replica holding GPUs on live nodes: `gpus` node -> indexes; `stopping` when it was asked to
    stop (its GPUs are coming free)."""

    id: str
    model: str
    profile: str
    scheduling_priority: int
    gpus: Mapping[str, tuple[int, ...]]
    load: float = 0.0
    stopping: bool = False

    def count_on(self, node: str, gpu_class: str, classes: Mapping[int, str]) -> int:
        return sum(1 for i in self.gpus.get(node, ()) if classes.get(i) == gpu_class)

    def describe(self) -> str:
        return f"{self.id} (model {self.model}, scheduling_priority {self.scheduling_priority})"


@dataclass(frozen=True)
class Room:
    """What makes room for one request: replicas to stop now, and every replica it waits for (those
    plus the ones already stopping), per node; `reserved`: free GPUs it counts on, per node."""

    stop: tuple[Holder, ...]
    wait_for: tuple[Holder, ...]
    nodes: tuple[str, ...]
    reserved: tuple[tuple[str, tuple[int, ...]], ...] = ()
    taken: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # holder id -> node -> GPUs

    @property
    def reason(self) -> str:
        names = [h.describe() for h in self.wait_for]
        if len(names) > _REASON_REPLICAS:
            names = names[:_REASON_REPLICAS] + [f"and {len(names) - _REASON_REPLICAS} more"]
        return f"waiting for {', '.join(names)} to drain"


def _classes(view: ClusterView, node: str) -> dict[int, str]:
    return {g.index: normalize_gpu_class(g.gpu_class) for g in view.nodes[node].gpus}


def _room_on(node: str, req: PlacementRequest, priority: int, view: ClusterView, holders: Sequence[Holder],
             budget: Mapping[tuple[str, str], int]) -> Room | None:
    cls_, need = req.gpu_class, req.gpu_count
    assert cls_
    classes = _classes(view, node)
    free = view.free.get(node, {}).get(cls_, [])
    have = min(len(free), need)
    reserved = tuple(free[:have])
    wait: list[Holder] = []
    taken: dict[str, dict[str, int]] = {}
    coming = sorted((h for h in holders if h.stopping and h.count_on(node, cls_, classes)), key=lambda h: h.id)
    for h in coming:
        if have >= need:
            break
        n = min(h.count_on(node, cls_, classes), need - have)
        have += n
        wait.append(h)
        taken[h.id] = {node: n}
    stop: list[Holder] = []
    if have < need:
        left = dict(budget)
        lower = sorted((h for h in holders if not h.stopping and h.scheduling_priority < priority
                        and h.count_on(node, cls_, classes)),
                       key=lambda h: (h.scheduling_priority, h.load, -h.count_on(node, cls_, classes), h.id))
        for h in lower:
            if have >= need:
                break
            if left.get((h.model, h.profile), 0) <= 0:
                continue  # never below the profile's min
            left[(h.model, h.profile)] -= 1
            n = min(h.count_on(node, cls_, classes), need - have)
            have += n
            stop.append(h)
            taken[h.id] = {node: n}
    if have < need:
        return None
    return Room(tuple(stop), tuple(wait + stop), (node,), ((node, reserved),) if reserved else (), taken)


def _cost(room: Room) -> tuple:
    return (len(room.stop), sorted(h.scheduling_priority for h in room.stop), sum(h.load for h in room.stop),
            len(room.wait_for), room.nodes)


def choose_victims(req: PlacementRequest, priority: int, view: ClusterView, holders: Sequence[Holder],
                   budget: Mapping[tuple[str, str], int]) -> Room | None:
    """What would make room for one replica of `req` (a GPU request placement just refused) whose
    profile has `scheduling_priority` `priority`; None when nothing can. `budget`: replicas each
    (model, profile) may still lose."""
    if not req.gpu_class:
        return None
    by_node: dict[str, list[Holder]] = {}
    for h in holders:
        for n in h.gpus:
            by_node.setdefault(n, []).append(h)
    nodes = [n for n in by_node if view.eligible(n, req)]
    budget = dict(budget)
    used: set[str] = set()
    parts: list[Room] = []
    for _ in range(req.nodes):  # a multi-node replica needs the room on `nodes` distinct nodes
        best = None
        for n in sorted(nodes):
            if n in {p.nodes[0] for p in parts}:
                continue
            room = _room_on(n, req, priority, view, [h for h in by_node[n] if h.id not in used], budget)
            if room is not None and (best is None or _cost(room) < _cost(best)):
                best = room
        if best is None:
            return None
        parts.append(best)
        for h in best.stop:
            budget[(h.model, h.profile)] -= 1
        used |= {h.id for h in best.wait_for}
    if not any(p.wait_for for p in parts):
        return None  # it fits as it is: not a question for preemption
    taken: dict[str, dict[str, int]] = {}
    for p in parts:
        for hid, per_node in p.taken.items():
            taken.setdefault(hid, {}).update(per_node)
    return Room(tuple(h for p in parts for h in p.stop), tuple(h for p in parts for h in p.wait_for),
                tuple(n for p in parts for n in p.nodes), tuple(r for p in parts for r in p.reserved), taken)


class Preemptor:
    """One planning pass's preemptions: the holders and budgets left after each promise."""

    def __init__(self, holders: Sequence[Holder], budget: Mapping[tuple[str, str], int]):
        self.holders = list(holders)
        self.budget = dict(budget)
        # What found no room stays without room for the rest of the pass (holders and budgets only
        # shrink): a thousand Pending replicas of one profile cost one search, not a thousand.
        self.hopeless: set[tuple] = set()

    def make_room(self, req: PlacementRequest, priority: int, view: ClusterView) -> Room | None:
        if not self.holders or (req.key, priority) in self.hopeless:
            return None
        room = choose_victims(req, priority, view, self.holders, self.budget)
        if room is None:
            self.hopeless.add((req.key, priority))
            return None
        for h in room.stop:
            self.budget[(h.model, h.profile)] -= 1
        # GPUs this request counts on leave the pool; the rest of a victim's are coming free for others.
        stopped = {h.id for h in room.stop}
        left: list[Holder] = []
        for h in self.holders:
            take = room.taken.get(h.id)
            if take:
                gpus = {n: idx[take.get(n, 0):] if n in take else idx for n, idx in h.gpus.items()}
                h = replace(h, gpus={n: i for n, i in gpus.items() if i})
            if h.id in stopped:
                h = replace(h, stopping=True)
            if h.gpus:
                left.append(h)
        self.holders = left
        for node, idxs in room.reserved:  # the free GPUs it counts on stay free for it
            view.allocate(req.model, Placement(nodes=(node,), gpus=((node, idxs),)), req.gpu_class)
        return room
