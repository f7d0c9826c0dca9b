"""One proxied request as the gateway reads it: `read_call(route, response_id, environ, tables, limit)
-> Call`, a frozen value read once from the WSGI environ and the routing tables, raising ApiError
(400, 404, 413, 503) for what cannot be sent; and what one endpoint is sent for it (`engine_request`).
What the gateway decides for the request (adapter, prefix, objective, tenant, the engines' order) is
gateway.request.plan's.

Only what routing needs is read: a JSON object's `model`/`stream`/`user`, a multipart form's `model`
field (gateway.request.forms), or the endpoint a response id leads to (gateway.response_ids). The
body is forwarded as it came unless the endpoint serves the model under another name, or its engine
orders or caches it by fields the gateway owns (`EngineDriver.order_changes`: vLLM's `priority` and
`cache_salt`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Mapping, NamedTuple

from gateway.errors import ApiError
from gateway.request.client import NO_CLIENT, ClientConn, client_of
from gateway.request.fields import check as check_fields
from gateway.request.forms import FormError, find_field
from gateway.request.surface import Route, engine_path
from gateway.response_ids import IdRewrite, unwrap
from gateway.routing.adapters import AdapterRoute
from gateway.routing.tables import Tables
from llmgw import surface as op
from llmgw.engines import ENGINES, get_engine
from llmgw.state.records import EndpointInfo

RESPONSE_OPS = frozenset({op.RESPONSES, op.RESPONSES_GET, op.RESPONSES_DELETE, op.RESPONSES_CANCEL})
ASSEMBLED_OPS = frozenset({op.CHAT, op.COMPLETIONS})  # answers gateway.upstream.assemble builds from a stream
# Request headers an engine needs; everything else (the client's API key above all) stays here.
FORWARD_REQUEST_HEADERS = (
    ("content-type", "CONTENT_TYPE"), ("accept", "HTTP_ACCEPT"), ("user-agent", "HTTP_USER_AGENT"),
    ("x-session-id", "HTTP_X_SESSION_ID"),
)  # (header, WSGI environ key); X-Request-Id is always set


@dataclass(frozen=True, slots=True)
class Call:
    """One proxied request as the gateway read it, never changed after: the model it names, and what
    to send to whichever endpoint takes it (`engine_request`). A continuation or a request that asks
    for its usage is another Call (`continued`, `with_usage`), made by `replace`, so no field is lost."""

    route: Route
    model: str
    data: bytes | None = None
    body: dict | None = None
    form_at: tuple[int, int] | None = None
    pin: str | None = None  # the endpoint a response id leads to
    response_id: tuple[str, str] | None = None  # (client id, engine id) named by the path
    previous: tuple[str, str] | None = None  # (client id, engine id) of a JSON body's previous_response_id
    query: str = ""
    client: ClientConn = NO_CLIENT  # the client's connection
    headers: Mapping[str, str] = field(default_factory=dict)  # what every attempt forwards (forward_headers)
    stream: bool = field(init=False)  # the client asked for a stream

    def __post_init__(self) -> None:
        object.__setattr__(self, "stream", self.body is not None and self.body.get("stream") is True)

    def with_usage(self) -> "Call":
        """A stream whose tokens count against a budget asks the engine for its usage chunk."""
        if self.stream and self.route.op in (op.CHAT, op.COMPLETIONS):  # a Responses stream ends with usage
            body, data = with_stream_usage(self.body, self.data)
            return replace(self, body=body, data=data) if data is not self.data else self
        return self

    def continued(self, body: dict) -> "Call":
        """This request with another body (the continuation of its answer), routed like it."""
        return replace(self, body=body, data=json.dumps(body).encode())

    def assembled(self, ep: EndpointInfo) -> ClientConn | None:
        """The client, when endpoint `ep` is asked for a stream the client did not ask for: its
        engine would not stop a non-streamed answer for a client that left, so the gateway reads
        the stream, watching the client, and answers with the whole body (gateway.upstream.assemble)."""
        if self.body is None or self.route.op not in ASSEMBLED_OPS or self.stream:
            return None
        engine = ENGINES.get(ep.engine)
        return self.client if engine is not None and not engine.aborts_unstreamed else None


class EngineRequest(NamedTuple):
    """What one endpoint is sent for a Call, and how its answer is read."""

    path: str
    body: bytes | None
    assemble: ClientConn | None  # Call.assembled
    rewrite: IdRewrite | None  # how the endpoint's response ids become the client's (Responses operations)


def engine_request(call: Call, adapter: AdapterRoute | None, ep: EndpointInfo, rank: int = 0,
                   cache_salt: str | None = None) -> EngineRequest:
    """The engine's path and body for endpoint `ep` (`adapter`: the LoRA adapter the request names;
    `rank`, `cache_salt`: the Plan's, what the engine orders and caches it by), whether its answer is
    assembled from a stream, and how its response ids are rewritten."""
    path = engine_path(ep.path(call.route.op), call.response_id[1] if call.response_id else None)
    if call.query:
        path += "?" + call.query
    assemble = call.assembled(ep)
    return EngineRequest(path, _engine_body(call, adapter, ep, assemble is not None, rank, cache_salt), assemble,
                         _rewrite(call, ep) if call.route.op in RESPONSE_OPS else None)


def _engine_body(call: Call, adapter: AdapterRoute | None, ep: EndpointInfo, assembled: bool, rank: int,
                 cache_salt: str | None) -> bytes | None:
    served = ep.served_name or ep.model or call.model
    body = call.body
    if body is not None:
        engine = ENGINES.get(ep.engine)
        changes = engine.order_changes(call.route.op, body, rank, cache_salt) if engine is not None else {}
        if assembled:
            opts = body.get("stream_options")
            changes.update(stream=True,
                           stream_options={**(opts if isinstance(opts, dict) else {}), "include_usage": True})
        if adapter is not None or ep.adapters:
            changes.update(adapter_changes(body, adapter, ep, served))
        elif served != call.model:
            changes["model"] = served
        if call.previous is not None:
            changes["previous_response_id"] = call.previous[1]
        return json.dumps({**body, **changes}).encode() if changes else call.data
    if call.form_at is not None and adapter is not None:
        served = adapter.name  # a form names the adapter as vLLM serves it
    if call.form_at is not None and served != call.model:
        start, end = call.form_at
        return call.data[:start] + served.encode() + call.data[end:]
    return call.data


def _rewrite(call: Call, ep: EndpointInfo) -> IdRewrite:
    """How the endpoint's response ids become the client's, for the Responses operations."""
    known = {pair[1]: pair[0] for pair in (call.response_id, call.previous) if pair is not None}
    return IdRewrite(ep.id, known, learn=True)


def adapter_changes(body: dict, adapter: AdapterRoute | None, ep: EndpointInfo, served: str) -> dict:
    """What a request for `adapter` (None: for the model) changes in its body on an endpoint that may
    hold adapters: as its engine must receive it (`EngineDriver.adapter_body`: vLLM and the sim name
    the adapter as `model`; llama.cpp keeps the model and gets a `lora` list of every adapter it
    holds, all at scale 0 but this one)."""
    out = get_engine(ep.engine).adapter_body({**body, "model": served}, adapter, ep.adapters)
    return {k: v for k, v in out.items() if k not in body or body[k] != v}


def salted(body: dict | None, cache_salt: str | None) -> dict | None:
    """`body` as the engines that take a salt see it, for matching its prefix against what they cache:
    a key that isolates its cache (`cache_salt`) replaces the client's own salt; else the body's stays."""
    return {**body, "cache_salt": cache_salt} if cache_salt and body is not None else body


def with_stream_usage(body: dict, data: bytes) -> tuple[dict, bytes]:
    """A streamed request of a key with a budget asks the engine for the usage chunk at its end
    (`stream_options.include_usage`), so its tokens are counted; the client then receives that chunk."""
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_usage") is True:
        return body, data
    body = {**body, "stream_options": {**(opts if isinstance(opts, dict) else {}), "include_usage": True}}
    return body, json.dumps(body).encode()


def forward_headers(environ: dict, rid: str, has_body: bool) -> dict[str, str]:
    """The request headers every attempt sends (an endpoint's credential is added per attempt)."""
    headers = {h: v for h, var in FORWARD_REQUEST_HEADERS if (v := environ.get(var))}
    headers["x-request-id"] = rid
    if has_body:
        headers.setdefault("content-type", "application/json")
    return headers


def read_body(environ: dict, limit: int) -> bytes:
    try:
        length = int(environ.get("CONTENT_LENGTH") or -1)
    except ValueError:
        raise ApiError("bad_request", "invalid Content-Length") from None
    if length > limit:
        raise ApiError("too_large", f"request body is {length} bytes; the limit is {limit}")
    stream = environ["wsgi.input"]
    data = stream.read(length) if length >= 0 else stream.read(limit + 1)
    if len(data) > limit:
        raise ApiError("too_large", f"request body is over the limit of {limit} bytes")
    if len(data) < length:  # the client stopped sending: never forward what may be half a request
        raise ApiError("bad_request", f"request body ended after {len(data)} of the {length} bytes "
                                      "its Content-Length says")
    return data


def read_call(route: Route, response_id: str | None, environ: dict, tables: Tables, limit: int, rid: str) -> Call:
    """Read what routing needs from the request: the body's model (JSON or a form field), or the
    endpoint a response id leads to; where its client is (gateway.request.client); and the headers
    every attempt forwards, with its id `rid`."""
    client = client_of(environ)
    if route.body == "none":
        ep, engine_id = response_endpoint(tables, response_id or "", "response")
        return Call(route, ep.model or ep.models[0], pin=ep.id, response_id=(response_id or "", engine_id),
                    query=environ.get("QUERY_STRING", ""), client=client, headers=forward_headers(environ, rid, False))
    headers = forward_headers(environ, rid, True)
    data = read_body(environ, limit)
    if route.body == "form":
        try:
            found = find_field(data, environ.get("CONTENT_TYPE", ""), "model")
        except FormError as e:
            raise ApiError("bad_request", str(e)) from None
        if found is None or not found[0]:
            raise ApiError("missing_model", "the form field 'model' is required")
        return Call(route, found[0], data, form_at=found[1:], client=client, headers=headers)
    try:
        body = json.loads(data)
    except ValueError as e:  # UnicodeDecodeError included: not UTF-8
        raise ApiError("bad_request", f"request body is not valid JSON: {e}") from None
    except RecursionError:  # valid or not, nested deeper than the parser's stack allows
        raise ApiError("bad_request", "request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError("bad_request", "request body must be a JSON object")
    model = body.get("model")
    check_fields(body, route.op)  # the common fields' types and ranges: one 400 whatever the engine
    if not isinstance(model, str) or not model:
        raise ApiError("missing_model", "'model' is required and must be a non-empty string")
    previous = body.get("previous_response_id") if route.op == op.RESPONSES else None
    if previous is None:
        return Call(route, model, data, body, client=client, headers=headers)
    if not isinstance(previous, str):
        raise ApiError("bad_request", "'previous_response_id' must be a string")
    ep, engine_id = response_endpoint(tables, previous, "previous_response_id")
    if model not in ep.models:
        raise ApiError("bad_request", f"previous_response_id {previous!r} belongs to model {ep.model!r}, "
                       f"not {model!r}")
    return Call(route, model, data, body, pin=ep.id, previous=(previous, engine_id), client=client, headers=headers)


def response_endpoint(tables: Tables, client_id: str, what: str) -> tuple[EndpointInfo, str]:
    """The endpoint a response id leads to, and the engine's own id; 404 when it leads nowhere."""
    parsed = unwrap(client_id)
    if parsed is None:
        raise ApiError("not_found", f"{what} {client_id!r} is not a response id this gateway issued")
    ep = tables.by_ref.get(parsed[0])
    if ep is None:
        raise ApiError("not_found", f"{what} {client_id!r} was created by an endpoint that is no longer "
                       "serving; its stored responses are gone with it")
    var = tables.missing_keys.get(ep.id)
    if var is not None:
        raise ApiError("no_replica", f"{what} {client_id!r} is held by endpoint {ep.id}, whose API key "
                       f"variable {var} is not set in this gateway's environment", 1)
    return ep, parsed[1]
