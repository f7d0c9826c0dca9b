"""Placement: which node(s) and which GPUs a new replica gets. Pure: no Redis, no clock.

`ClusterView.build(...)` indexes a snapshot once (free GPU indexes per node and class, replica counts
per node and per model); `place(request, view)` answers a `Placement` or a `NoPlacement` with a reason
a human understands, without changing the view; the planner then calls `view.allocate(...)` so the
next request of the same pass sees the capacity that one took.

Rules (docs/control-plane.md): GPU replicas are bin-packed (the node where `gpu.count` GPUs of the
class fit most tightly, so whole nodes stay free for big replicas); CPU replicas are spread (fewest
replicas of the model, then fewest replicas overall, then name). Pools and `node_selector` restrict
the eligible nodes; cordoned and draining nodes get nothing new. A multi-node request takes `nodes`
distinct nodes of the pool, each with the full GPU request, head first.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Mapping

from llmgw.gpus import normalize_gpu_class
from llmgw.state.records import NodeAdmin, NodeInfo

# How many nodes a reason lists before it says "and N more": enough to diagnose, short enough to read.
_REASON_NODES = 8


@dataclass(frozen=True)
class PlacementRequest:
    """What one replica of a profile needs. `exclude`: nodes it must avoid (a crash-looping home)."""

    model: str
    profile: str
    pool: str = "default"
    selector: tuple[tuple[str, str], ...] = ()
    gpu_class: str | None = None  # normalised; None = CPU
    gpu_count: int = 0
    nodes: int = 1
    exclude: frozenset[str] = frozenset()

    @classmethod
    def for_profile(cls, model: str, profile, exclude: Iterable[str] = ()) -> "PlacementRequest":
        """Build the request from a catalog `Profile`."""
        gpu = profile.gpu
        return cls(
            model=model,
            profile=profile.name,
            pool=profile.pool,
            selector=tuple(sorted(profile.node_selector.items())),
            gpu_class=normalize_gpu_class(gpu.gpu_class) if gpu else None,
            gpu_count=gpu.count if gpu else 0,
            nodes=profile.nodes,
            exclude=frozenset(exclude),
        )

    @property
    def plain(self) -> bool:
        """No selector and no exclusion: every schedulable node of the pool is eligible."""
        return not self.selector and not self.exclude

    @cached_property
    def key(self) -> tuple:
        """Requests with the same key get the same answer from the same view."""
        return (self.model, self.pool, self.selector, self.gpu_class, self.gpu_count, self.nodes, self.exclude)


@dataclass(frozen=True)
class Placement:
    nodes: tuple[str, ...]  # head first
    gpus: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (node, GPU indexes) per node; () for CPU

    @property
    def head(self) -> str:
        return self.nodes[0]

    def gpus_dict(self) -> dict[str, list[int]]:
        return {n: list(idx) for n, idx in self.gpus}


@dataclass(frozen=True)
class NoPlacement:
    reason: str


def _fmt_selector(selector: tuple[tuple[str, str], ...]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in selector) + "}"


def _fmt_list(items: list[str]) -> str:
    if len(items) <= _REASON_NODES:
        return ", ".join(items)
    return ", ".join(items[:_REASON_NODES]) + f", and {len(items) - _REASON_NODES} more"


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


def place(req: PlacementRequest, view: ClusterView) -> Placement | NoPlacement:
    """Where one replica of `req` goes in `view`, or why it cannot go anywhere. Does not change `view`."""
    if req.gpu_class:
        return _place_gpu(req, view)
    return _place_cpu(req, view, peek=True)


def place_and_allocate(req: PlacementRequest, view: ClusterView) -> Placement | NoPlacement:
    """`place`, then `view.allocate` when it succeeded: what the planner does for each request."""
    if req.gpu_class:
        result = _place_gpu(req, view)
    else:
        result = _place_cpu(req, view, peek=False)
        if isinstance(result, Placement):  # _place_cpu already updated its heap; count the rest
            view.allocate(req.model, result)
        return result
    if isinstance(result, Placement):
        view.allocate(req.model, result, req.gpu_class)
    return result


# --- GPU: bin-packing ------------------------------------------------------------------------------
def _place_gpu(req: PlacementRequest, view: ClusterView) -> Placement | NoPlacement:
    assert req.gpu_class
    buckets = view.buckets.get((req.pool, req.gpu_class), {})
    chosen: list[str] = []
    # Tightest fit first: the smallest free count that still holds the request, then by name.
    plain = req.plain  # bucket members are schedulable nodes of the pool: eligible unless filtered
    cls_, need = req.gpu_class, req.gpu_count
    for count in range(need, max(buckets, default=0) + 1):  # a handful of counts (GPUs per node)
        for name in buckets.get(count, ()):
            if plain or view.eligible(name, req):
                chosen.append(name)
                if len(chosen) == req.nodes:
                    gpus = tuple((n, tuple(view.free[n][cls_][:need])) for n in chosen)
                    return Placement(nodes=tuple(chosen), gpus=gpus)
    return NoPlacement(_gpu_reason(req, view, len(chosen)))


def _gpu_reason(req: PlacementRequest, view: ClusterView, fitting: int) -> str:
    base = _eligibility_problem(req, view)
    if base:
        return base
    cls_ = req.gpu_class
    buckets = view.buckets.get((req.pool, cls_), {})
    # Eligible nodes with this class, most free first (buckets are by free count, names sorted).
    with_class = [n for c in sorted(buckets, reverse=True) for n in buckets[c] if req.plain or view.eligible(n, req)]
    if not with_class:
        pool_nodes = [n for n in view.pool_nodes.get(req.pool, ()) if view.eligible(n, req)]
        others = sorted({c for n in pool_nodes for c in view.total.get(n, {})})
        have = f" (it has: {', '.join(others)})" if others else " (it has no GPUs)"
        return f'no node in pool "{req.pool}" has {cls_} GPUs{have}' + _excluded_note(req, view)
    listing = _fmt_list([f"{n} {view.free_gpus(n, cls_)}" for n in with_class[:_REASON_NODES + 1]])
    if len(with_class) > _REASON_NODES + 1:
        listing = ", ".join(f"{n} {view.free_gpus(n, cls_)}" for n in with_class[:_REASON_NODES])
        listing += f", and {len(with_class) - _REASON_NODES} more"
    if req.nodes > 1:
        return (
            f'needs {req.nodes} nodes in pool "{req.pool}" with {req.gpu_count} free {cls_} each, '
            f"{fitting} have them (free: {listing})" + _excluded_note(req, view)
        )
    return f'no node in pool "{req.pool}" has {req.gpu_count} free {cls_} (free: {listing})' + _excluded_note(
        req, view
    )


def _eligibility_problem(req: PlacementRequest, view: ClusterView) -> str | None:
    """A reason when no node is even eligible (ignoring capacity), else None."""
    pool = view.pool_nodes.get(req.pool, [])
    if not pool:
        return f'no schedulable node in pool "{req.pool}"' + _excluded_note(req, view, always=True)
    if req.selector and not any(view.eligible(n, req) for n in pool):
        return f'no node in pool "{req.pool}" matches node_selector {_fmt_selector(req.selector)}'
    if req.exclude and not any(view.eligible(n, req) for n in pool):
        return f'no node in pool "{req.pool}" other than {", ".join(sorted(req.exclude))}'
    return None


def _excluded_note(req: PlacementRequest, view: ClusterView, always: bool = False) -> str:
    names = view.pool_excluded.get(req.pool, [])
    if not names:
        return "" if not always else " (no live node in it)"
    parts = []
    for n in names:
        a = view.admin.get(n) or NodeAdmin()
        parts.append(f"{n} {'draining' if a.draining else 'cordoned'}")
    return f"; not schedulable: {_fmt_list(parts)}"


# --- CPU: spreading ------------------------------------------------------------------------------
def _spread_heap(req: PlacementRequest, view: ClusterView) -> list[tuple[int, int, str]]:
    names = view.pool_nodes.get(req.pool, ())
    if not req.plain:
        names = [n for n in names if view.eligible(n, req)]
    per_model, per_node, model = view.per_model_node, view.per_node, req.model
    heap = [(per_model.get((model, n), 0), per_node.get(n, 0), n) for n in names]
    heapq.heapify(heap)
    return heap


def _place_cpu(req: PlacementRequest, view: ClusterView, peek: bool) -> Placement | NoPlacement:
    """Fewest replicas of this model, then fewest overall, then name; a lazy heap per request key keeps
    a pass over thousands of replicas at O(log nodes) each instead of a scan of every node."""
    heap = view._spread_heaps.get(req.key)
    if heap is None:
        heap = _spread_heap(req, view)
        if not peek:
            view._spread_heaps[req.key] = heap
    if peek:
        heap = list(heap)
    chosen: list[tuple[int, int, str]] = []
    while heap and len(chosen) < req.nodes:
        mc, tc, n = heapq.heappop(heap)
        cur = (view.per_model_node.get((req.model, n), 0), view.per_node.get(n, 0))
        if (mc, tc) != cur:  # counts grew since this entry was pushed: re-queue with the truth
            if view.schedulable(n):
                heapq.heappush(heap, (*cur, n))
            continue
        chosen.append((mc, tc, n))
    if len(chosen) < req.nodes:
        for entry in chosen:  # put back what we took; nothing is allocated
            heapq.heappush(heap, entry)
        problem = _eligibility_problem(req, view)
        if problem:
            return NoPlacement(problem)
        return NoPlacement(
            f'needs {req.nodes} nodes in pool "{req.pool}", only {len(chosen)} are eligible'
            + _excluded_note(req, view)
        )
    if not peek:
        # The counts each chosen node will have once `allocate` runs.
        for mc, tc, n in chosen:
            heapq.heappush(heap, (mc + 1, tc + 1, n))
    return Placement(nodes=tuple(n for _, _, n in chosen))


def spread_many(req: PlacementRequest, view: ClusterView, k: int) -> tuple[list[Placement], NoPlacement | None]:
    """Place `k` replicas of a CPU request one after another (each sees the ones before), allocating
    them; returns the placements and, if fewer than `k` fit, why the rest did not."""
    if req.gpu_class or req.nodes != 1:
        out: list[Placement] = []
        for _ in range(k):
            res = place_and_allocate(req, view)
            if isinstance(res, NoPlacement):
                return out, res
            out.append(res)
        return out, None
    heap = view._spread_heaps.get(req.key)
    if heap is None:
        heap = view._spread_heaps[req.key] = _spread_heap(req, view)
    if not heap:
        return [], NoPlacement(_eligibility_problem(req, view) or f'no eligible node in pool "{req.pool}"')
    per_model, per_node, model = view.per_model_node, view.per_node, req.model
    pop, push = heapq.heappop, heapq.heappush
    placed: list[Placement] = []
    cache: dict[str, Placement] = {}  # placements are immutable: one per node is enough
    while len(placed) < k:
        mc, tc, n = pop(heap)
        cur_mc, cur_tc = per_model.get((model, n), 0), per_node.get(n, 0)
        if mc != cur_mc or tc != cur_tc:  # counts grew since this entry was pushed
            push(heap, (cur_mc, cur_tc, n))
            continue
        per_model[(model, n)] = mc + 1
        per_node[n] = tc + 1
        push(heap, (mc + 1, tc + 1, n))
        p = cache.get(n)
        if p is None:
            p = cache[n] = Placement(nodes=(n,))
        placed.append(p)
    return placed, None
