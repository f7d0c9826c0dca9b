"""The one table that turns every gateway failure into an OpenAI-shaped error body.

Views raise `ApiError(kind, message)`; gateway.http.answer.error_response renders it as
`{"error": {"message", "type", "code"}}` with the status, and `Retry-After` where it applies; an error
about one field of the request also names it, as OpenAI's do, in `param` (gateway.request.fields).
An engine's own error answer is put in the same shape by `engine_error` (its message kept), so a
client sees one dialect whichever part refused it.
"""

from __future__ import annotations

import json

# kind -> (HTTP status, OpenAI error type, code)
TABLE: dict[str, tuple[int, str, str]] = {
    "bad_request": (400, "invalid_request_error", "invalid_request"),
    "missing_model": (400, "invalid_request_error", "model_required"),
    # A field of the request the gateway checks itself (gateway.request.fields), OpenAI's codes for it.
    "invalid_type": (400, "invalid_request_error", "invalid_type"),
    "invalid_value": (400, "invalid_request_error", "invalid_value"),
    "missing_field": (400, "invalid_request_error", "missing_required_parameter"),
    "unauthorized": (401, "authentication_error", "invalid_api_key"),
    "key_expired": (401, "authentication_error", "expired_api_key"),
    "forbidden": (403, "permission_error", "admin_key_required"),
    "batches_forbidden": (403, "permission_error", "batches_not_allowed"),
    # X-LLMGW-Tenant from a key that may not name sub-tenants (llmgw keys update NAME --sub-tenants).
    "sub_tenant_forbidden": (403, "permission_error", "sub_tenants_not_allowed"),
    "model_not_found": (404, "invalid_request_error", "model_not_found"),
    "not_found": (404, "invalid_request_error", "not_found"),
    # The path exists, the request's model does not serve it: the request's to change (which model).
    "unsupported": (400, "invalid_request_error", "unsupported_endpoint"),
    "method_not_allowed": (405, "invalid_request_error", "method_not_allowed"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
    # An engine's answer that the prompt does not fit its context (OpenAI's own code for it).
    "context_too_long": (400, "invalid_request_error", "context_length_exceeded"),
    # nginx's "client closed request": logged and counted, never read by the client that left.
    "client_gone": (499, "invalid_request_error", "client_closed_request"),
    "shed": (429, "rate_limit_error", "overloaded"),
    "rate_limited": (429, "rate_limit_error", "rate_limit_exceeded"),
    "budget_exceeded": (429, "insufficient_quota", "budget_exceeded"),
    "internal": (500, "server_error", "internal_error"),
    "upstream_error": (502, "server_error", "upstream_error"),
    "no_replica": (503, "server_error", "no_ready_replica"),
    "auth_unavailable": (503, "server_error", "auth_unavailable"),
    "gateway_full": (503, "server_error", "gateway_overloaded"),
    "unavailable": (503, "server_error", "state_unavailable"),
    "upstream_timeout": (504, "server_error", "upstream_timeout"),
}


class ApiError(Exception):
    def __init__(self, kind: str, message: str, retry_after: int | None = None, param: str | None = None):
        assert kind in TABLE, kind
        self.kind, self.message, self.retry_after = kind, message, retry_after
        self.param = param  # the request's field it is about ("temperature", "messages[1].role"), or None
        super().__init__(f"{kind}: {message}")

    @property
    def status(self) -> int:
        return TABLE[self.kind][0]


def error_body(kind: str, message: str, param: str | None = None) -> dict:
    """The OpenAI-shaped body; `param` only for an error about one field of the request."""
    _, etype, code = TABLE[kind]
    if param is None:
        return {"error": {"message": message, "type": etype, "code": code}}
    return {"error": {"message": message, "type": etype, "code": code, "param": param}}


# An engine's 4xx status -> the kind whose type and code its answer carries (other 4xx: bad_request).
ENGINE_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "too_large", 429: "shed"}
ENGINE_MESSAGE_MAX = 2000  # characters of a non-JSON error body kept as the message
# How engines say a prompt does not fit: llama-server's error type, vLLM's message (OpenAI's wording).
CONTEXT_TYPES = frozenset({"exceed_context_size_error"})
CONTEXT_WORDS = "maximum context length"


def engine_error(status: int, payload: bytes, endpoint: str) -> tuple[int, bytes]:
    """An engine's error answer (status >= 400) in the gateway's shape: the engine's message, and the
    type and code of this table. llama-server answers `{"error": {"code": 400, "type": ...}}`, vLLM
    `{"error": {"type": "BadRequestError", "code": 400}}` (older: the same at the top level), FastAPI
    `{"detail": ...}`, a proxy plain text. The status is kept, except 401 and 403: only the gateway's
    credential reaches an engine (never the client's key), so the engine refusing it is the
    gateway's failure, 502, not the client's."""
    message, etype = _engine_message(payload)
    message = message or f"the engine answered HTTP {status} with no message"
    if status in (401, 403):
        message = f"endpoint {endpoint} refused the gateway's credential (HTTP {status}): {message}"
        status, kind = 502, "upstream_error"
    elif status >= 500:
        kind = "upstream_error"
    elif status == 400 and (etype in CONTEXT_TYPES or CONTEXT_WORDS in message):
        kind = "context_too_long"
    else:
        kind = ENGINE_KINDS.get(status, "bad_request")
    return status, json.dumps(error_body(kind, message)).encode()


def _engine_message(payload: bytes) -> tuple[str | None, str | None]:
    """(message, the engine's error type) of an error body, whichever dialect it is in."""
    try:
        doc = json.loads(payload)
    except ValueError:
        text = payload.decode("utf-8", "replace").strip()
        return (text[:ENGINE_MESSAGE_MAX] or None), None
    if not isinstance(doc, dict):
        return json.dumps(doc)[:ENGINE_MESSAGE_MAX], None
    err = doc["error"] if doc.get("error") else doc  # vLLM before 0.10 put its fields at the top level
    if isinstance(err, str):
        return err, None
    if isinstance(err, dict):
        etype = err.get("type") if isinstance(err.get("type"), str) else None
        if isinstance(err.get("message"), str):
            return err["message"], etype
        detail = err.get("detail")
        if isinstance(detail, str):
            return detail, etype
        if isinstance(detail, list):  # FastAPI's validation errors: [{loc, msg, type}]
            parts = [f"{'.'.join(str(x) for x in d.get('loc', ()))}: {d.get('msg')}" for d in detail
                     if isinstance(d, dict)]
            return "; ".join(parts) or None, etype
    return json.dumps(doc)[:ENGINE_MESSAGE_MAX], None
