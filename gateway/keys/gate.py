"""What a request's API key lets it do, over the in-memory key table: who asks (401), whether it is an
admin (403), the key's policy (gateway.keys.policy: 401, 404, 429), its rate limits (429) and the
priority its requests may claim. No Redis except the rate-limited keys' one round trip.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from gateway.errors import ApiError
from gateway.keys.limits import RateLimiter
from gateway.keys.policy import Deny, ModelRef, decide
from gateway.keys.table import ApiKey, KeyTable
from gateway.keys.usage import UsageRecorder
from llmgw.state.keypolicy import PRIORITIES, Tenant, TenantRefused, cap_priority, tenant_of
from llmgw.state.clock import Clock

NOT_LOADED = "the gateway has not loaded its API keys yet"
ASK = object()  # `check`: authenticate the caller (else the key is given, already authenticated)


class Verdict(NamedTuple):
    """What a request's key lets it do, once checked: who asks, the criticality it may claim, and whom
    it is served for in fair order (None: a retrieval by id, never queued; or an unknown model)."""

    key: ApiKey | None
    priority: str
    tenant: Tenant | None


class KeyGate:
    def __init__(self, table: KeyTable, usage: UsageRecorder, limiter: RateLimiter, clock: Clock, metrics,
                 default_priority: str, names_of: Callable[[str], frozenset[str]],
                 not_ready: Callable[[], str | None] = lambda: None):
        self.table, self.usage, self.limiter, self.clock, self.metrics = table, usage, limiter, clock, metrics
        self.default_priority = default_priority
        self.names_of = names_of  # every name of a model (the routing tables'), for a key's `--models`
        self.not_ready = not_ready  # why the process cannot serve yet, for the 503 that says so

    def check(self, environ: dict, model: str, known: bool | None, by_id: bool = False, key=ASK) -> Verdict:
        """Every check of a request's key, in order, raising the first refusal: who asks (401), the
        priority header (400), the key's policy for `model` (401, 404, 429), the sub-tenant it names
        (403, 400) and its rate limits (429). A model the gateway does not `know` is refused by the
        caller, after the policy and before the rate limits; `known` None: the gateway has not loaded
        its models yet, and refuses the request (503) once it knows who asks. A read by response id
        (`by_id`) is critical and has no tenant: it generates nothing. `key`: the caller, already
        authenticated (a read by id asks who calls before saying whether the response exists)."""
        if key is ASK:
            key = self.authenticate(environ)
        if known is None:
            return Verdict(key, "critical" if by_id else self.default_priority, None)
        prio = "critical" if by_id else self.priority(environ.get("HTTP_X_LLMGW_PRIORITY") or None, key)
        if key is not None:
            self.enforce(key, model)  # expiry, the key's models, its budget: 401 / 404 / 429
        if not known:
            return Verdict(key, prio, None)
        tenant = None if by_id else self.tenant(environ, key)
        if key is not None:
            self.limit(key, model)
        return Verdict(key, prio, tenant)

    def authenticate(self, environ: dict) -> ApiKey | None:
        """The caller's key when LLMGW_GATEWAY_AUTH requires one (None when it does not)."""
        table = self.table
        if table.mode == "off":
            return None
        if not table.loaded:
            raise ApiError("auth_unavailable", self.not_ready() or NOT_LOADED, 1)
        if not table.required:
            return None
        return self._presented(environ)

    def _presented(self, environ: dict) -> ApiKey:
        auth = environ.get("HTTP_AUTHORIZATION", "")
        presented = auth[7:].strip() if auth[:7].lower() == "bearer " else environ.get("HTTP_API_KEY")
        if not presented:
            raise ApiError("unauthorized", "missing API key: send 'Authorization: Bearer <key>'")
        key = self.table.lookup(presented)
        if key is None:
            raise ApiError("unauthorized", "invalid API key")
        return key

    def identify(self, environ: dict) -> ApiKey:
        """The caller's key, whatever LLMGW_GATEWAY_AUTH says (a request about a key needs one): 401
        without a valid, unexpired key."""
        if not self.table.loaded:
            raise ApiError("auth_unavailable", self.not_ready() or NOT_LOADED, 1)
        key = self._presented(environ)
        self.enforce(key, None)
        return key

    def require_admin(self, environ: dict, open_without_keys: bool = False) -> ApiKey | None:
        """For the admin APIs: the caller's key if it is an admin key (`llmgw keys create|update
        --admin`); 401 without a valid key, 403 with an ordinary one. In every auth mode:
        `LLMGW_GATEWAY_AUTH=off` opens the OpenAI API, never the admin APIs that act on keys. The
        read-only console (`open_without_keys`) is open while the gateway requires no key at all
        (auth off, or `auto` before any key exists), like the rest of the gateway; then None."""
        table = self.table
        if open_without_keys and (table.mode == "off" or (table.loaded and not table.required)):
            return None
        key = self.identify(environ)
        if not key.admin:
            raise ApiError("forbidden", f"API key {key.name!r} is not an admin key; the console and the admin APIs "
                                        "need one (llmgw keys create NAME --admin)")
        return key

    def enforce(self, key: ApiKey, model: str | None) -> None:
        """The key's policy (gateway.keys.policy.decide) over the in-memory tables; raises the denial."""
        now = self.clock.time()
        period = key.period(now)
        used = self.usage.spent(key.id, period.id) if period is not None else 0
        d = decide(key, ModelRef(model, self.names_of(model)) if model is not None else None, used, now)
        if isinstance(d, Deny):
            self.metrics.child(self.metrics.denied, d.kind).inc()
            raise ApiError(d.kind, d.message, d.retry_after)

    def limit(self, key: ApiKey, model: str) -> None:
        """The key's rate limits (one Redis round trip, only for a key that has one); raises the 429."""
        limited = self.limiter.check(key)
        if limited:
            self.metrics.shed.labels(model, "rate_limited").inc()
            raise ApiError("rate_limited", f"rate limit of {limited[0]} reached for key {key.name!r}", limited[1])

    def priority(self, header: str | None, key: ApiKey | None) -> str:
        """The request's criticality: the header, capped at the key's (a key's own priority, else the
        default, is the highest its requests may claim); without a key the header stands."""
        if header is not None and header not in PRIORITIES:
            raise ApiError("bad_request", f"X-LLMGW-Priority must be one of {', '.join(PRIORITIES)}, got {header!r}")
        if key is None:
            return header or self.default_priority
        ceiling = key.priority or self.default_priority
        return cap_priority(header, ceiling) if header else ceiling

    def tenant(self, environ: dict, key: ApiKey | None) -> Tenant:
        """Whom the request is served for when its model is saturated: its key, and the sub-tenant a
        trusted front end names in X-LLMGW-Tenant (gateway.routing.fairness); 403 when the key may
        not name one, 400 for a malformed name."""
        got = tenant_of(key, environ.get("HTTP_X_LLMGW_TENANT"))
        if isinstance(got, TenantRefused):
            raise ApiError("sub_tenant_forbidden" if got.kind == "untrusted" else "bad_request", got.message)
        return got
