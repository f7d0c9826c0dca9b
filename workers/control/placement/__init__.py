"""Placement: which node(s) and which GPUs a new replica gets. Pure: no Redis, no clock.

`ClusterView.build(...)` indexes a snapshot once (free GPU indexes per node and class, replica counts
per node and per model); `place(request, view)` answers a `Placement` or a `NoPlacement` with a reason
a human understands and, per live node, why it was refused (`llmgw explain` shows them), without
changing the view; the planner then calls `view.allocate(...)` so the
next request of the same pass sees the capacity that one took.

Rules (docs/control-plane.md): GPU replicas are bin-packed (the node where `gpu.count` GPUs of the
class fit most tightly, so whole nodes stay free for big replicas); CPU replicas are spread (fewest
replicas of the model, then fewest replicas overall, then name). Pools and `node_selector` restrict
the eligible nodes; cordoned and draining nodes get nothing new. A multi-node request takes `nodes`
distinct nodes of the pool, each with the full GPU request, head first.
"""

from workers.control.placement.place import place, place_and_allocate, spread_many
from workers.control.placement.reasons import node_refusal, refusals
from workers.control.placement.types import NoPlacement, Placement, PlacementRequest, Refusal
from workers.control.placement.view import ClusterView

__all__ = ["place", "place_and_allocate", "spread_many", "node_refusal", "refusals", "NoPlacement", "Placement",
           "PlacementRequest", "Refusal", "ClusterView"]
