"""The paths the gateway proxies, and how it reads each request to route it. Pure.

The operations and their paths are llmgw's vocabulary (`llmgw.surface`); this table adds what the
gateway needs to know of each: where the model name is (a JSON body, a multipart form field, or a
response id in the path that leads to the endpoint that created it), and whether the answer's
service time teaches the router an endpoint's speed (only generating operations do: a tokenize or
a retrieval takes milliseconds and would make a slow endpoint look fast).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw import surface as op


@dataclass(frozen=True)
class Route:
    op: str
    body: str  # "json": `model` in a JSON object; "form": a multipart form field; "none": no body
    learns: bool = False  # its service time is a sample of the endpoint's speed
    by_id: bool = False  # the path names a response id: routed to the endpoint that created it


ROUTES: dict[str, Route] = {
    op.CHAT: Route(op.CHAT, "json", learns=True),
    op.COMPLETIONS: Route(op.COMPLETIONS, "json", learns=True),
    op.RESPONSES: Route(op.RESPONSES, "json", learns=True),
    op.EMBEDDINGS: Route(op.EMBEDDINGS, "json"),
    op.RERANK: Route(op.RERANK, "json"),
    op.SCORE: Route(op.SCORE, "json"),
    op.TOKENIZE: Route(op.TOKENIZE, "json"),
    op.DETOKENIZE: Route(op.DETOKENIZE, "json"),
    op.TRANSCRIPTIONS: Route(op.TRANSCRIPTIONS, "form"),
    op.RESPONSES_GET: Route(op.RESPONSES_GET, "none", by_id=True),
    op.RESPONSES_DELETE: Route(op.RESPONSES_DELETE, "none", by_id=True),
    op.RESPONSES_CANCEL: Route(op.RESPONSES_CANCEL, "none", by_id=True),
}
assert set(ROUTES) == set(op.OPERATIONS), "every operation needs a route"

# (method, path) -> route, for the paths without an id.
FIXED: dict[tuple[str, str], Route] = {
    (method, path): ROUTES[name] for name, (method, path) in op.OPERATIONS.items() if "{id}" not in path
}
RESPONSES_PREFIX = "/v1/responses/"
_BY_ID: dict[tuple[str, str], Route] = {  # (method, what follows the id) -> route
    (method, path[len(RESPONSES_PREFIX) + len("{id}"):]): ROUTES[name]
    for name, (method, path) in op.OPERATIONS.items() if "{id}" in path
}


def match(method: str, path: str) -> tuple[Route, str | None] | None:
    """The route of a request and the response id its path names (None for the others); None when
    the gateway does not proxy it (Flask answers 404 or 405)."""
    route = FIXED.get((method, path))
    if route is not None:
        return route, None
    if not path.startswith(RESPONSES_PREFIX):
        return None
    rest = path[len(RESPONSES_PREFIX):]
    rid, sep, tail = rest.partition("/")
    route = _BY_ID.get((method, sep + tail))
    return (route, rid) if route is not None and rid else None


def flask_rules() -> list[tuple[str, list[str]]]:
    """Every proxied path as a Flask rule with its methods (Flask then answers 405 for the others)."""
    rules: dict[str, list[str]] = {}
    for method, path in op.OPERATIONS.values():
        rules.setdefault(path.replace("{id}", "<rid>"), []).append(method)
    return sorted(rules.items())


def engine_path(template: str, response_id: str | None) -> str:
    return template if response_id is None else template.replace("{id}", response_id)
