"""Why a replica cannot be placed, in words a human understands: one reason for the whole request,
and per live node why it refused (`llmgw explain` shows both)."""

from __future__ import annotations

from llmgw.state.node_records import NodeAdmin
from workers.control.placement.types import NoPlacement, PlacementRequest, Refusal
from workers.control.placement.view import ClusterView

# How many nodes a reason lists before it says "and N more": enough to diagnose, short enough to read.
_REASON_NODES = 8


def _fmt_selector(selector: tuple[tuple[str, str], ...]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in selector) + "}"


def _fmt_list(items: list[str]) -> str:
    if len(items) <= _REASON_NODES:
        return ", ".join(items)
    return ", ".join(items[:_REASON_NODES]) + f", and {len(items) - _REASON_NODES} more"



def gpu_reason(req: PlacementRequest, view: ClusterView, fitting: int) -> str:
    base = eligibility_problem(req, view)
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
        return f'no node in pool "{req.pool}" has {cls_} GPUs{have}' + excluded_note(req, view)
    listing = _fmt_list([f"{n} {view.free_gpus(n, cls_)}" for n in with_class[:_REASON_NODES + 1]])
    if len(with_class) > _REASON_NODES + 1:
        listing = ", ".join(f"{n} {view.free_gpus(n, cls_)}" for n in with_class[:_REASON_NODES])
        listing += f", and {len(with_class) - _REASON_NODES} more"
    if req.nodes > 1:
        return (
            f'needs {req.nodes} nodes in pool "{req.pool}" with {req.gpu_count} free {cls_} each, '
            f"{fitting} have them (free: {listing})" + excluded_note(req, view)
        )
    return f'no node in pool "{req.pool}" has {req.gpu_count} free {cls_} (free: {listing})' + excluded_note(
        req, view
    )


def eligibility_problem(req: PlacementRequest, view: ClusterView) -> str | None:
    """A reason when no node is even eligible (ignoring capacity), else None."""
    pool = view.pool_nodes.get(req.pool, [])
    if not pool and not view.nodes:
        return no_node_yet(req.pool, view.joined)
    if not pool:
        return f'no schedulable node in pool "{req.pool}"' + excluded_note(req, view, always=True)
    if req.selector and not any(view.eligible(n, req) for n in pool):
        return f'no node in pool "{req.pool}" matches node_selector {_fmt_selector(req.selector)}'
    if req.exclude and not any(view.eligible(n, req) for n in pool):
        return f'no node in pool "{req.pool}" other than {", ".join(sorted(req.exclude))}'
    if (req.weights_size or req.too_small) and not any(view.eligible(n, req) for n in pool):
        return weights_problem(req, view, pool)
    return None


def no_node_yet(pool: str, joined: bool) -> str:
    """No node is live at all: before the first heartbeat (a fleet starting, `llmgw up`) the replica
    waits for a node to join, which is no failure; after one, every node agent is gone."""
    if not joined:
        return f'waiting for a node to join pool "{pool}" (no node agent has sent its first heartbeat yet)'
    return f'waiting for a node to join pool "{pool}" (no node agent is live: none sent a heartbeat lately)'


def weights_problem(req: PlacementRequest, view: ClusterView, pool: list[str]) -> str:
    """Why no node of the pool takes the weights: the fit estimate against the largest device that
    does not fit (with what would), else the node with the most room's disk."""
    found = [(r.kind, r.why, n) for n in pool if (r := view.weights_refusal(n, req)) is not None]
    fits = sorted(((view.device_memory(n, req.gpu_class) or 0, why) for kind, why, n in found if kind == "fit"),
                  reverse=True)
    if fits:
        return fits[0][1]
    disks = sorted(((view.room_left(n) or 0, why) for kind, why, n in found if kind == "disk"), reverse=True)
    return disks[0][1] if disks else f'no node in pool "{req.pool}" takes its weights'



def excluded_note(req: PlacementRequest, view: ClusterView, always: bool = False) -> str:
    names = view.pool_excluded.get(req.pool, [])
    if not names:
        return "" if not always else " (no live node in it)"
    parts = []
    for n in names:
        a = view.admin.get(n) or NodeAdmin()
        parts.append(f"{n} {'draining' if a.draining else 'cordoned'}")
    return f"; not schedulable: {_fmt_list(parts)}"



# --- why each node was refused ----------------------------------------------------------------------
def node_refusal(name: str, req: PlacementRequest, view: ClusterView) -> str | None:
    """Why live node `name` cannot take `req` now, in a few words; None when it could."""
    info = view.nodes[name]
    if info.pool != req.pool:
        return f'in pool "{info.pool}", not "{req.pool}"'
    flags = view.admin.get(name)
    if flags is not None and flags.draining:
        return "draining"
    if flags is not None and flags.cordoned:
        return "cordoned"
    if name in req.exclude:
        return "the replica crash-loops there"
    for k, v in req.selector:
        have = info.labels.get(k)
        if have != v:
            return f"label {k}={have}, not {v}" if have is not None else f"no label {k} (wants {k}={v})"
    if req.gpu_class:
        cls_ = req.gpu_class
        total = view.total.get(name, {}).get(cls_, 0)
        if total == 0:
            others = sorted(view.total.get(name, {}))
            return f"has no {cls_} GPUs ({'it has ' + ', '.join(others) if others else 'it has no GPUs'})"
    weights = view.weights_refusal(name, req) if (req.weights_size or req.too_small) else None
    if weights is not None:
        return weights.why
    if req.gpu_class:
        free = view.free_gpus(name, cls_)
        if free < req.gpu_count:
            sick = view.unhealthy.get(name)
            note = "; " + "; ".join(f"GPU {i} is unhealthy: {why}" for i, why in sorted(sick.items())) if sick else ""
            return f"{free} of {total} {cls_} free, needs {req.gpu_count}{note}"
    return None


def refusals(req: PlacementRequest, view: ClusterView) -> tuple[Refusal, ...]:
    """Every live node grouped by `node_refusal` (nodes that could take it are grouped too when the
    request needs several nodes and there were not enough of them); most nodes first."""
    groups: dict[str, list[str]] = {}
    for name in sorted(view.nodes):
        why = node_refusal(name, req, view)
        if why is None:
            if req.nodes <= 1:
                continue
            why = f"fits, but the replica needs {req.nodes} such nodes"
        groups.setdefault(why, []).append(name)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return tuple(Refusal(why, tuple(names[:_REASON_NODES]), len(names)) for why, names in ordered)


def refused(req: PlacementRequest, view: ClusterView, reason: str) -> NoPlacement:
    return NoPlacement(reason, refusals(req, view))

