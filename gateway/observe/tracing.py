"""What the gateway's request path names in its trace (llmgw.tracing, docs/tracing.md): the route a
span is named by, and how a queue wait ended. Pure; the hooks themselves sit in gateway.http.proxy
and gateway.http.answer, and cost a no-op method call each while tracing is off."""

from __future__ import annotations

from llmgw import surface as op

# The route template of each operation (`http.route`): "/v1/responses/{id}", never the id itself.
ROUTE_PATHS: dict[str, str] = {name: path for name, (_method, path) in op.OPERATIONS.items()}


def route_path(operation: str) -> str:
    return ROUTE_PATHS.get(operation, operation)


def queue_outcome(result) -> str:
    """How a wait in a model's queue ended (`WaitQueue.wait`'s Choice, Rejection or None): admitted,
    timeout (or the queue was full), or the kind of the rejection that ended it (the model went
    away). A Rejection is told by its `kind` (gateway.observe does not import the routing core)."""
    if result is None:
        return "timeout"
    return getattr(result, "kind", None) or "admitted"
