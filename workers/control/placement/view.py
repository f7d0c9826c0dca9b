"""`ClusterView`: the planner's index of free GPUs and replica counts, built once per pass."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from llmgw.gpus import normalize_gpu_class
from llmgw.state.records import NodeAdmin, NodeInfo
from workers.control.placement.types import Placement, PlacementRequest


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

    # --- building ----------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        nodes: Mapping[str, NodeInfo],
        admin: Mapping[str, NodeAdmin],
        allocated: Iterable[tuple[str, str, dict[str, list[int]]]] = (),
        active: Iterable[tuple[str, Iterable[str]]] = (),
    ) -> "ClusterView":
        """`allocated`: (model, replica id, {node: [gpu index]}) of every replica that is not Stopped;
        `active`: (model, nodes) of every replica that counts for spreading."""
        view = cls(nodes=nodes, admin=admin)
        taken: dict[str, set[int]] = {}
        for _model, _rid, gpus in allocated:
            for node, idxs in gpus.items():
                if node in nodes:
                    taken.setdefault(node, set()).update(idxs)
        classes: dict[str, str] = {}  # agents report normalised names already; normalise each once
        for name, info in nodes.items():
            by_class: dict[str, list[int]] = {}
            for g in info.gpus:
                c = classes.get(g.gpu_class)
                if c is None:
                    c = classes[g.gpu_class] = normalize_gpu_class(g.gpu_class)
                by_class.setdefault(c, []).append(g.index)
            view.total[name] = {c: len(ix) for c, ix in by_class.items()}
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
        """Pool, labels, admin flags and exclusions; not capacity."""
        info = self.nodes.get(name)
        if info is None or info.pool != req.pool or name in req.exclude or not self.schedulable(name):
            return False
        labels = info.labels
        return all(labels.get(k) == v for k, v in req.selector)

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

