"""The proxied request, a shell over the pure decisions: read it (gateway.request.call), check its key
(gateway.keys.gate), plan it (gateway.request.plan), send it (gateway.http.attempt: admission, the
attempt, retries before the first byte), answer (gateway.http.answer); every refusal worded by
gateway.http.refusal.
"""

from __future__ import annotations

import logging
from typing import Callable

from gateway.config import GatewaySettings
from gateway.errors import ApiError
from gateway.http.answer import Answers, RawAnswer
from gateway.http.attempt import Proxied, Sender
from gateway.http.refusal import not_loaded, refusal
from gateway.keys.gate import ASK, KeyGate
from gateway.observe.feeders import feeder_of
from llmgw.state.keypolicy import ANONYMOUS, cache_salt_of
from gateway.observe.metrics import Metrics
from gateway.observe.saturation import SaturationSignals
from gateway.observe.tracing import route_path
from gateway.observe.traffic import TrafficCounter
from gateway.request.call import read_call
from gateway.request.plan import plan
from gateway.request.targets import asked as asked_targets
from gateway.request.surface import Route
from gateway.routing.choice import Rejection, RouteRequest
from gateway.routing.router import Router
from llmgw.state.clock import Clock
from llmgw.tracing import NOOP_REQUEST, OFF

log = logging.getLogger("llmgw.gateway")


class Proxy:
    """Handles proxied requests on the raw WSGI environ (Flask's request machinery is skipped: it cost
    ~0.3 ms per request, as much as the rest of the gateway's work)."""

    def __init__(self, cfg: GatewaySettings, clock: Clock, router: Router, gate: KeyGate, sender: Sender,
                 answers: Answers, metrics: Metrics, traffic: TrafficCounter, saturation: SaturationSignals,
                 not_ready: Callable[[], str | None], tracing=OFF):
        self.cfg, self.clock, self.router, self.gate, self.sender = cfg, clock, router, gate, sender
        self.answers, self.metrics, self.traffic, self.saturation = answers, metrics, traffic, saturation
        self.not_ready = not_ready
        self.tracing = tracing  # llmgw.tracing: Tracing, or OFF (its calls then do nothing)
        self.prefix_routing = cfg.routing.prefill_ms_per_token > 0

    def __call__(self, route: Route, response_id: str | None, environ: dict, rid: str) -> RawAnswer:
        """Read the request once (a frozen Call), check its key once, plan it (a frozen Plan), send it
        as a `Proxied` (gateway.http.attempt: its every send), and answer with what the engine sent."""
        t0 = self.clock.monotonic()
        router, gate = self.router, self.gate
        # Kept in the environ: whatever ends the request (an answer, a refusal) ends its trace.
        trace = environ["llmgw.trace"] = self.tracing.request(
            environ, rid, environ.get("REQUEST_METHOD", "POST"), route_path(route.op))
        key = gate.authenticate(environ) if route.by_id else ASK  # who asks, before saying whether a response exists
        if route.by_id and not router.tables.loaded:
            raise not_loaded(self.not_ready())
        call = read_call(route, response_id, environ, router.tables, self.cfg.max_body_bytes, rid)
        asked = asked_targets(environ)  # its latency targets' headers (400 naming a bad one)
        tables = router.tables
        known = call.model in tables.known_models if tables.loaded else None
        verdict = gate.check(environ, call.model, known, route.by_id, key)
        trace.identify(call.model, verdict.key.name if verdict.key is not None else None, verdict.priority)
        if known is None:
            raise not_loaded(self.not_ready())
        if not known:
            # Unknown names get no per-name state and no metric label of their own (cardinality).
            self.metrics.rejected_unknown.inc()
            raise refusal(Rejection("unknown_model", call.model), RouteRequest(call.model), tables)
        if not route.by_id:
            router.requested(call.model)
        if verdict.key is not None and verdict.key.budget:
            call = call.with_usage()
        key = verdict.key
        p = plan(call, tables, verdict.priority, verdict.tenant, environ.get("HTTP_X_SESSION_ID"), self.prefix_routing,
                 asked, key.slo() if key is not None else None, cache_salt_of(key))
        environ["llmgw.model"] = p.canon  # known: charts may count it
        if p.targets:  # a refusal of it counts against its targets (`refused`)
            environ["llmgw.targets"] = (key.id if key is not None else ANONYMOUS,
                                        p.tenant.name if p.tenant is not None else ANONYMOUS)
        # A batch line names its feeder: the gateway report counts its lines (gateway.observe.feeders).
        feeder = feeder_of(environ.get("HTTP_X_LLMGW_FEEDER")) if p.priority == "batch" else ""
        ex = Proxied(self.sender, call, p, verdict.key, rid, t0, environ.get("REQUEST_METHOD", "POST"), trace, feeder)
        hop = ex.send(first=True)
        try:
            return self.answers.respond(ex, hop)
        except BaseException:
            hop.close()  # the answer did not take it
            raise

    def refused(self, environ: dict, err: ApiError) -> None:
        """A proxied request ended in an error answer: count it for its model's charts (only known
        models have one), and a shed one as a sign of saturation."""
        environ.get("llmgw.trace", NOOP_REQUEST).refused(err.status, err.kind, err.message)
        model = environ.get("llmgw.model")
        if model is None:
            return
        self.traffic.request(model, error=err.status >= 500, shed=err.kind in ("shed", "rate_limited"))
        if err.kind == "shed":
            self.saturation.shed(model)
        targeted = environ.get("llmgw.targets")
        if targeted is not None and err.kind != "client_gone":  # refused (early, or after a wait): not met
            self.metrics.child(self.metrics.slo, model, targeted[1], "", "refused").inc()
            self.gate.usage.targets(targeted[0], model, False)
