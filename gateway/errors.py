"""The one table that turns every gateway failure into an OpenAI-shaped error body.

Views raise `ApiError(kind, message)`; gateway.http.answer.error_response renders it as
`{"error": {"message", "type", "code"}}` with the status, and `Retry-After` where it applies.
"""

from __future__ import annotations

# kind -> (HTTP status, OpenAI error type, code)
TABLE: dict[str, tuple[int, str, str]] = {
    "bad_request": (400, "invalid_request_error", "invalid_request"),
    "missing_model": (400, "invalid_request_error", "model_required"),
    "unauthorized": (401, "authentication_error", "invalid_api_key"),
    "key_expired": (401, "authentication_error", "expired_api_key"),
    "forbidden": (403, "permission_error", "admin_key_required"),
    "batches_forbidden": (403, "permission_error", "batches_not_allowed"),
    "model_not_found": (404, "invalid_request_error", "model_not_found"),
    "not_found": (404, "invalid_request_error", "not_found"),
    "unsupported": (404, "invalid_request_error", "unsupported_endpoint"),
    "method_not_allowed": (405, "invalid_request_error", "method_not_allowed"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
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
    def __init__(self, kind: str, message: str, retry_after: int | None = None):
        assert kind in TABLE, kind
        self.kind, self.message, self.retry_after = kind, message, retry_after
        super().__init__(f"{kind}: {message}")

    @property
    def status(self) -> int:
        return TABLE[self.kind][0]


def error_body(kind: str, message: str) -> dict:
    _, etype, code = TABLE[kind]
    return {"error": {"message": message, "type": etype, "code": code}}
