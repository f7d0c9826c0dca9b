"""`ClusterView`: the planner's index of free GPUs and replica counts, built once per pass."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from llmgw.gpus import gpu_memory_mb, normalize_gpu_class
from llmgw.state.node_records import NodeAdmin, NodeInfo
from workers.control.placement.types import Placement, PlacementRequest, WeightsRefusal


@dataclass
class ClusterView:
    """The planner's working index of the fleet, built once per pass; changed only by `allocate` and
    `spread_many` (which allocates as it goes)."""

    nodes: Mapping[str, NodeInfo]
    admin: Mapping[str, NodeAdmin]
    # node -> class -> sorted free GPU indexes
    free: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    # node -> class -> total GPUs of that class
    total: dict[str, dict[str, int]] = field(default_factory=dict)
    # (pool, class) -> free count -> sorted schedulable node names with that many free
    buckets: dict[tuple[str, str], dict[int, list[str]]] = field(default_factory=dict)
    # pool -> sorted schedulable node names
    pool_nodes: dict[str, list[str]] = field(default_factory=dict)
    # pool -> sorted live node names that are cordoned or draining (for reasons)
    pool_excluded: dict[str, list[str]] = field(default_factory=dict)
    per_node: dict[str, int] = field(default_factory=dict)  # active replicas per node
    per_model_node: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, node) -> n
    _spread_heaps: dict[tuple, list] = field(default_factory=dict)
    # node -> {GPU index: why it is unhealthy}: those GPUs are never free (only nodes that have one)
    unhealthy: dict[str, dict[int, str]] = field(default_factory=dict)
    # Weights placed this pass: bytes of room each node has left, and the sources it gets.
    room: dict[str, int] = field(default_factory=dict)
    incoming: set[tuple[str, str]] = field(default_factory=set)
    _memory: dict[tuple[str, str | None], int | None] = field(default_factory=dict)
    # Some node agent ever sent a heartbeat (Snapshot.known): with no live node, the fleet is starting
    # (no node joined yet) or has lost every node; the reasons say which.
    joined: bool = False

    # --- building ----------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        nodes: Mapping[str, NodeInfo],
        admin: Mapping[str, NodeAdmin],
        allocated: Iterable[tuple[str, str, dict[str, list[int]]]] = (),
        active: Iterable[tuple[str, Iterable[str]]] = (),
        joined: bool = False,
    ) -> "ClusterView":
        """`allocated`: (model, replica id, {node: [gpu index]}) of every replica that is not Stopped;
        `active`: (model, nodes) of every replica that counts for spreading; `joined`: some node
        ever sent a heartbeat."""
        view = cls(nodes=nodes, admin=admin, joined=joined)
        taken: dict[str, set[int]] = {}
        for _model, _rid, gpus in allocated:
            for node, idxs in gpus.items():
                if node in nodes:
                    taken.setdefault(node, set()).update(idxs)
        classes: dict[str, str] = {}  # agents report normalised names already; normalise each once
        for name, info in nodes.items():
            by_class: dict[str, list[int]] = {}
            sick = None
            for g in info.gpus:
                c = classes.get(g.gpu_class)
                if c is None:
                    c = classes[g.gpu_class] = normalize_gpu_class(g.gpu_class)
                by_class.setdefault(c, []).append(g.index)
                if not g.healthy:
                    sick = sick if sick is not None else view.unhealthy.setdefault(name, {})
                    sick[g.index] = g.health or "unhealthy"
            view.total[name] = {c: len(ix) for c, ix in by_class.items()}
            if sick:  # an unhealthy GPU is never free: it gets no replica until it reads healthy again
                used = taken.get(name)
                taken[name] = (used | set(sick)) if used else set(sick)
            used = taken.get(name)
            if used:
                view.free[name] = {c: sorted(i for i in ix if i not in used) for c, ix in by_class.items()}
            else:
                view.free[name] = {c: sorted(ix) for c, ix in by_class.items()}
        for name in sorted(nodes):
            info = nodes[name]
            if view.schedulable(name):
                view.pool_nodes.setdefault(info.pool, []).append(name)
                for c, ix in view.free[name].items():
                    view.buckets.setdefault((info.pool, c), {}).setdefault(len(ix), []).append(name)
            else:
                view.pool_excluded.setdefault(info.pool, []).append(name)
        # Counter counts in C: this runs over every replica of the fleet on every pass.
        pairs = [(model, n) for model, rnodes in active for n in rnodes]
        view.per_model_node = dict(Counter(pairs))
        view.per_node = dict(Counter(n for _, n in pairs))
        return view

    def schedulable(self, name: str) -> bool:
        a = self.admin.get(name)
        return name in self.nodes and not (a and (a.cordoned or a.draining))

    def eligible(self, name: str, req: PlacementRequest) -> bool:
        """Pool, labels, admin flags, exclusions, and the weights' disk and fit checks; not GPU capacity."""
        info = self.nodes.get(name)
        if info is None or info.pool != req.pool or name in req.exclude or not self.schedulable(name):
            return False
        labels = info.labels
        if not all(labels.get(k) == v for k, v in req.selector):
            return False
        return not (req.weights_size or req.too_small) or self.weights_refusal(name, req) is None

    def weights_refusal(self, name: str, req: PlacementRequest) -> WeightsRefusal | None:
        """Why node `name` cannot take `req`'s weights (they do not fit its devices, or its disk);
        None when it can."""
        if req.too_small:
            mem = self.device_memory(name, req.gpu_class)
            if mem:
                why = dict(req.too_small).get(mem)
                if why is not None:
                    return WeightsRefusal("fit", why)
        if req.weights_size and not self.holds(name, req.weights):
            room = self.room_left(name)
            if room is not None and room < req.weights_size:
                info = self.nodes[name]
                where = info.weights_dir or "its weights dir"
                return WeightsRefusal("disk", f"needs {_gib(req.weights_size)}, {_gib(room)} free under {where}")
        return None

    def device_memory(self, name: str, gpu_class: str | None) -> int | None:
        """MiB of one GPU of `gpu_class` on node `name` (the smallest, if they differ), or of the node's
        memory for a CPU request; None or 0 when not known."""
        key = (name, gpu_class)
        if key not in self._memory:
            info = self.nodes[name]
            if gpu_class is None:
                self._memory[key] = info.memory_mb or None
            else:
                mems = [gpu_memory_mb(gpu_class, g.memory_mb) for g in info.gpus
                        if normalize_gpu_class(g.gpu_class) == gpu_class]
                self._memory[key] = min(mems) if mems else None
        return self._memory[key]

    def holds(self, name: str, source: str | None) -> bool:
        """Node `name` has `source` complete, or gets it from a replica placed this pass."""
        return source is not None and ((name, source) in self.incoming or self.nodes[name].holds(source))

    def room_left(self, name: str) -> int | None:
        """Bytes a new download may take on node `name` after this pass's placements; None: not reported."""
        return self.room.get(name, self.nodes[name].weights_room)

    def reserve_weights(self, req: PlacementRequest, placement: Placement) -> None:
        """A placed replica downloads its weights on each node that lacks them: that room is taken."""
        if not req.weights:
            return
        for node in placement.nodes:
            if not self.holds(node, req.weights):
                room = self.room_left(node)
                if room is not None:
                    self.room[node] = room - req.weights_size
                self.incoming.add((node, req.weights))

    def free_gpus(self, node: str, gpu_class: str) -> int:
        return len(self.free.get(node, {}).get(gpu_class, ()))

    # --- mutation ------------------------------------------------------------------------------------
    def allocate(self, model: str, placement: Placement, gpu_class: str | None = None) -> None:
        """Take what `placement` uses: its GPUs leave the free lists, its nodes count one more replica."""
        for node, idxs in placement.gpus:
            info = self.nodes[node]
            free = self.free[node]
            cls_ = gpu_class or next(c for c, ix in free.items() if idxs and idxs[0] in ix)
            before = free.get(cls_, [])
            k = len(idxs)
            if tuple(before[:k]) == tuple(idxs):  # the usual case: the lowest free indexes
                after = before[k:]
            else:
                taken = set(idxs)
                after = [i for i in before if i not in taken]
            free[cls_] = after
            if self.schedulable(node):
                bucket = self.buckets.setdefault((info.pool, cls_), {})
                old = bucket.get(len(before), [])
                pos = bisect_left(old, node)
                if pos < len(old) and old[pos] == node:
                    del old[pos]
                insort(bucket.setdefault(len(after), []), node)
        for node in placement.nodes:
            self.per_node[node] = self.per_node.get(node, 0) + 1
            self.per_model_node[(model, node)] = self.per_model_node.get((model, node), 0) + 1



def _gib(n: float) -> str:
    return f"{n / 1024 ** 3:.1f} GiB" if abs(n) >= 1024 ** 3 else f"{n / 1024 ** 2:.1f} MiB"
