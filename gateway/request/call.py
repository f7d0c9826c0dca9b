"""One proxied request as the gateway reads it: `read_call(route, response_id, environ, tables, limit)
-> Call`, from the WSGI environ and the routing tables, raising ApiError (400, 404, 413, 503) for
what cannot be sent.

Only what routing needs is read: a JSON object's `model`/`stream`/`user`, a multipart form's `model`
field (gateway.request.forms), or the endpoint a response id leads to (gateway.response_ids). The
body is forwarded as it came unless the endpoint serves the model under another name.
"""

from __future__ import annotations

import json

from gateway.errors import ApiError
from gateway.request.client import ClientConn, client_of
from gateway.request.fields import check as check_fields
from gateway.request.forms import FormError, find_field
from gateway.request.surface import Route, engine_path
from gateway.response_ids import IdRewrite, unwrap
from gateway.routing.adapters import AdapterRoute
from gateway.routing.choice import COMPLETION, FIRST_TOKEN
from gateway.routing.prefixkeys import opens_conversation, prefix_of
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


class Call:
    """One proxied request as the gateway read it: the model it names, and what to send to whichever
    endpoint takes it (the body with the endpoint's served name, the engine's path)."""

    __slots__ = ("route", "model", "data", "body", "form_at", "pin", "response_id", "previous", "query", "adapter",
                 "client", "prefix", "prompt_tokens", "opens", "objective", "tenant", "charge")

    def __init__(self, route: Route, model: str, data: bytes | None = None, body: dict | None = None,
                 form_at: tuple[int, int] | None = None, pin: str | None = None,
                 response_id: tuple[str, str] | None = None, previous: tuple[str, str] | None = None,
                 query: str = ""):
        self.route, self.model, self.data, self.body, self.form_at = route, model, data, body, form_at
        self.pin = pin  # the endpoint a response id leads to
        self.response_id = response_id  # (client id, engine id) named by the path
        self.previous = previous  # (client id, engine id) of a JSON body's previous_response_id
        self.query = query
        self.adapter: AdapterRoute | None = None  # the LoRA adapter it names (set by the proxy)
        self.client = ClientConn(None)  # the client's connection (read_call sets it)
        # For prefix-cache routing (set by `plan_prefix`): block keys, prompt tokens, objective.
        self.prefix: tuple[int, ...] = ()
        self.prompt_tokens = 0.0
        self.opens = False  # it starts a conversation (gateway.routing.prefixkeys.opens_conversation)
        self.objective = COMPLETION
        # Fair queueing (gateway.routing.fairness): whom it is served for (None: a retrieval, which is
        # never queued), and what its tenant was charged when it was sent (gateway.routing.ledger.Charge).
        self.tenant = None
        self.charge = None

    def plan_prefix(self, canon: str, objective: str | None, enabled: bool = True) -> None:
        """What routing needs for the prefix cache: the prompt's block keys (seeded with the model's
        canonical name and the adapter), and what the request minimises: the catalog's
        `routing.objective` for the model, else its first token when it streams, else its completion."""
        self.objective = objective or (FIRST_TOKEN if self.streams() else COMPLETION)
        if enabled and self.body is not None:
            self.prefix, self.prompt_tokens = prefix_of(self.body, self.route.op, canon,
                                                        self.adapter.name if self.adapter is not None else "")
            # (read only with block keys: where a prompt's history goes, gateway.routing.choice._pick)
            self.opens = bool(self.prefix) and opens_conversation(self.body, self.route.op)

    @property
    def affinity(self) -> str | None:
        """The body's OpenAI `user`, which keeps a session on one endpoint (X-Session-ID wins)."""
        user = self.body.get("user") if self.body is not None else None
        return user if isinstance(user, str) and user else None

    def streams(self) -> bool:
        return self.body is not None and self.body.get("stream") is True

    def ask_for_usage(self) -> None:
        """A stream whose tokens count against a budget asks the engine for its usage chunk."""
        if self.streams() and self.route.op in (op.CHAT, op.COMPLETIONS):  # a Responses stream ends with usage
            self.body, self.data = with_stream_usage(self.body, self.data)

    def assembled(self, ep: EndpointInfo) -> ClientConn | None:
        """The client, when endpoint `ep` is asked for a stream the client did not ask for: its
        engine would not stop a non-streamed answer for a client that left, so the gateway reads
        the stream, watching the client, and answers with the whole body (gateway.upstream.assemble)."""
        if self.body is None or self.route.op not in ASSEMBLED_OPS or self.streams():
            return None
        engine = ENGINES.get(ep.engine)
        return self.client if engine is not None and not engine.aborts_unstreamed else None

    def request_for(self, ep: EndpointInfo) -> tuple[str, bytes | None]:
        """The engine's path and the body for endpoint `ep`."""
        path = engine_path(ep.path(self.route.op), self.response_id[1] if self.response_id else None)
        if self.query:
            path += "?" + self.query
        served = ep.served_name or ep.model or self.model
        if self.body is not None:
            changes = {}
            if self.assembled(ep) is not None:
                opts = self.body.get("stream_options")
                changes = {"stream": True,
                           "stream_options": {**(opts if isinstance(opts, dict) else {}), "include_usage": True}}
            if self.adapter is not None or ep.adapters:
                changes.update(adapter_changes(self.body, self.adapter, ep, served))
            elif served != self.model:
                changes["model"] = served
            if self.previous is not None:
                changes["previous_response_id"] = self.previous[1]
            return path, (json.dumps({**self.body, **changes}).encode() if changes else self.data)
        if self.form_at is not None and self.adapter is not None:
            served = self.adapter.name  # a form names the adapter as vLLM serves it
        if self.form_at is not None and served != self.model:
            start, end = self.form_at
            return path, self.data[:start] + served.encode() + self.data[end:]
        return path, self.data

    def rewrite(self, ep: EndpointInfo) -> IdRewrite | None:
        """How the endpoint's response ids become the client's, for the Responses operations."""
        if self.route.op not in RESPONSE_OPS:
            return None
        known = {pair[1]: pair[0] for pair in (self.response_id, self.previous) if pair is not None}
        return IdRewrite(ep.id, known, learn=True)


def adapter_changes(body: dict, adapter: AdapterRoute | None, ep: EndpointInfo, served: str) -> dict:
    """What a request for `adapter` (None: for the model) changes in its body on an endpoint that may
    hold adapters: as its engine must receive it (`EngineDriver.adapter_body`: vLLM and the sim name
    the adapter as `model`; llama.cpp keeps the model and gets a `lora` list of every adapter it
    holds, all at scale 0 but this one)."""
    out = get_engine(ep.engine).adapter_body({**body, "model": served}, adapter, ep.adapters)
    return {k: v for k, v in out.items() if k not in body or body[k] != v}


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


def read_call(route: Route, response_id: str | None, environ: dict, tables: Tables, limit: int) -> Call:
    """Read what routing needs from the request: the body's model (JSON or a form field), or the
    endpoint a response id leads to; and where its client is (gateway.request.client)."""
    call = _read(route, response_id, environ, tables, limit)
    call.client = client_of(environ)
    return call


def _read(route: Route, response_id: str | None, environ: dict, tables: Tables, limit: int) -> Call:
    if route.body == "none":
        ep, engine_id = response_endpoint(tables, response_id or "", "response")
        return Call(route, ep.model or ep.models[0], pin=ep.id, response_id=(response_id or "", engine_id),
                    query=environ.get("QUERY_STRING", ""))
    data = read_body(environ, limit)
    if route.body == "form":
        try:
            found = find_field(data, environ.get("CONTENT_TYPE", ""), "model")
        except FormError as e:
            raise ApiError("bad_request", str(e)) from None
        if found is None or not found[0]:
            raise ApiError("missing_model", "the form field 'model' is required")
        return Call(route, found[0], data, form_at=found[1:])
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
        return Call(route, model, data, body)
    if not isinstance(previous, str):
        raise ApiError("bad_request", "'previous_response_id' must be a string")
    ep, engine_id = response_endpoint(tables, previous, "previous_response_id")
    if model not in ep.models:
        raise ApiError("bad_request", f"previous_response_id {previous!r} belongs to model {ep.model!r}, "
                       f"not {model!r}")
    return Call(route, model, data, body, pin=ep.id, previous=(previous, engine_id))


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
