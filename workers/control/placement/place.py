"""`place(request, view)`: GPU replicas bin-packed, CPU replicas spread (docs/control-plane.md)."""

from __future__ import annotations

import heapq

from workers.control.placement.reasons import eligibility_problem, excluded_note, gpu_reason, refused
from workers.control.placement.types import NoPlacement, Placement, PlacementRequest
from workers.control.placement.view import ClusterView


def place(req: PlacementRequest, view: ClusterView) -> Placement | NoPlacement:
    """Where one replica of `req` goes in `view`, or why it cannot go anywhere. Does not change `view`."""
    if req.hold:
        return NoPlacement(req.hold)
    if req.gpu_class:
        return _place_gpu(req, view)
    return _place_cpu(req, view, peek=True)


def place_and_allocate(req: PlacementRequest, view: ClusterView) -> Placement | NoPlacement:
    """`place`, then `view.allocate` when it succeeded: what the planner does for each request."""
    if req.hold:
        return NoPlacement(req.hold)
    if req.gpu_class:
        result = _place_gpu(req, view)
    else:
        result = _place_cpu(req, view, peek=False)
        if isinstance(result, Placement):  # _place_cpu already updated its heap; count the rest
            view.allocate(req.model, result)
            view.reserve_weights(req, result)
        return result
    if isinstance(result, Placement):
        view.allocate(req.model, result, req.gpu_class)
        view.reserve_weights(req, result)
    return result



# --- GPU: bin-packing ------------------------------------------------------------------------------
def _place_gpu(req: PlacementRequest, view: ClusterView) -> Placement | NoPlacement:
    assert req.gpu_class
    if req.weights:  # nodes that hold the weights first (no download), tightest fit among them
        holding = _pack(req, view, lambda n: view.holds(n, req.weights))
        if isinstance(holding, Placement):
            return holding
    found = _pack(req, view, None)
    return found if isinstance(found, Placement) else refused(req, view, gpu_reason(req, view, found))


def _pack(req: PlacementRequest, view: ClusterView, only) -> Placement | int:
    """The tightest fit (the smallest free count that still holds the request, then by name) among the
    eligible nodes (`only` narrows them), or how many nodes fit when there are too few."""
    buckets = view.buckets.get((req.pool, req.gpu_class), {})
    chosen: list[str] = []
    plain = req.plain  # bucket members are schedulable nodes of the pool: eligible unless filtered
    cls_, need = req.gpu_class, req.gpu_count
    for count in range(need, max(buckets, default=0) + 1):  # a handful of counts (GPUs per node)
        for name in buckets.get(count, ()):
            if (only is None or only(name)) and (plain or view.eligible(name, req)):
                chosen.append(name)
                if len(chosen) == req.nodes:
                    gpus = tuple((n, tuple(view.free[n][cls_][:need])) for n in chosen)
                    return Placement(nodes=tuple(chosen), gpus=gpus)
    return len(chosen)



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
    if req.weights:
        return _place_cpu_weights(req, view)
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
        problem = eligibility_problem(req, view)
        if problem:
            return refused(req, view, problem)
        return refused(req, view, f'needs {req.nodes} nodes in pool "{req.pool}", only {len(chosen)} are eligible'
                        + excluded_note(req, view))
    if not peek:
        # The counts each chosen node will have once `allocate` runs.
        for mc, tc, n in chosen:
            heapq.heappush(heap, (mc + 1, tc + 1, n))
    return Placement(nodes=tuple(n for _, _, n in chosen))


def _place_cpu_weights(req: PlacementRequest, view: ClusterView) -> Placement | NoPlacement:
    """A CPU replica with a remote source: spread first (fewest of this model), then the nodes that
    hold its weights, then fewest replicas overall: one scan of the eligible nodes (the room and the
    holders change as the pass places, which a heap would not see)."""
    names = [n for n in view.pool_nodes.get(req.pool, ()) if view.eligible(n, req)]
    if len(names) < req.nodes:
        problem = eligibility_problem(req, view)
        return refused(req, view, problem or f'needs {req.nodes} nodes in pool "{req.pool}", only {len(names)} '
                                             "are eligible" + excluded_note(req, view))
    order = sorted(names, key=lambda n: (view.per_model_node.get((req.model, n), 0),
                                         not view.holds(n, req.weights), view.per_node.get(n, 0), n))
    return Placement(nodes=tuple(order[:req.nodes]))


def spread_many(req: PlacementRequest, view: ClusterView, k: int) -> tuple[list[Placement], NoPlacement | None]:
    """Place `k` replicas of a CPU request one after another (each sees the ones before), allocating
    them; returns the placements and, if fewer than `k` fit, why the rest did not."""
    if req.hold:
        return [], NoPlacement(req.hold)
    if req.gpu_class or req.nodes != 1 or req.weights:
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
        return [], refused(req, view, eligibility_problem(req, view) or f'no eligible node in pool "{req.pool}"')
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
