"""The proxied request, a shell over the pure decisions: read it (gateway.request.call), check its key
(gateway.keys.gate), route and admit it (gateway.routing), forward it and retry before the first byte
(gateway.routing.retry), answer (gateway.http.answer); every refusal worded by gateway.http.refusal.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Collection

from gateway.config import GatewaySettings
from gateway.errors import ApiError
from gateway.http.answer import Answers, RawAnswer
from gateway.http.refusal import TimedOut, attempt_failed, not_loaded, refusal
from gateway.keys.gate import KeyGate
from gateway.observe.demand import DemandSignal
from gateway.observe.metrics import Metrics
from gateway.observe.saturation import SaturationSignals
from gateway.observe.tracing import queue_outcome, route_path
from gateway.observe.traffic import TrafficCounter
from gateway.request.call import Call, forward_headers, read_call
from gateway.request.client import ClientConn
from gateway.request.surface import Route
from gateway.routing.adapters import NO_ADAPTER, load_hold
from gateway.routing.admission import Send, Shed, Wait, admit, drain_time
from gateway.routing.choice import Choice, Rejection, RouteRequest
from gateway.routing.coldstart import hold
from gateway.routing.queue import GONE, WaitQueue, WaitQueues
from gateway.routing.retry import Deliver, GiveUp, Outcome, next_attempt
from gateway.routing.router import Lease, Router
from gateway.upstream.client import Upstream, UpstreamConnectError, UpstreamTimeout
from llmgw.state.clock import Clock
from llmgw.tracing import NOOP_REQUEST, OFF

log = logging.getLogger("llmgw.gateway")


class Proxy:
    """Handles proxied requests on the raw WSGI environ (Flask's request machinery is skipped: it cost
    ~0.3 ms per request, as much as the rest of the gateway's work)."""

    def __init__(self, cfg: GatewaySettings, clock: Clock, router: Router, gate: KeyGate, upstream: Upstream,
                 queues: WaitQueues, answers: Answers, metrics: Metrics, traffic: TrafficCounter,
                 saturation: SaturationSignals, demand: DemandSignal, not_ready: Callable[[], str | None],
                 tracing=OFF):
        self.cfg, self.clock, self.router, self.gate, self.upstream = cfg, clock, router, gate, upstream
        self.queues, self.answers, self.metrics, self.traffic = queues, answers, metrics, traffic
        self.saturation, self.demand, self.not_ready = saturation, demand, not_ready
        self.tracing = tracing  # llmgw.tracing: Tracing, or OFF (its calls then do nothing)

    def __call__(self, route: Route, response_id: str | None, environ: dict, rid: str) -> RawAnswer:
        t0 = self.clock.monotonic()
        router, gate = self.router, self.gate
        # Kept in the environ: whatever ends the request (an answer, a refusal) ends its trace.
        trace = environ["llmgw.trace"] = self.tracing.request(
            environ, rid, environ.get("REQUEST_METHOD", "POST"), route_path(route.op))
        if route.by_id:  # who asks, before saying whether a response exists
            key = gate.authenticate(environ)
            if not router.tables.loaded:
                raise not_loaded(self.not_ready())
        call = read_call(route, response_id, environ, router.tables, self.cfg.max_body_bytes)
        model = call.model
        if not route.by_id:
            key = gate.authenticate(environ)
        # Reading, deleting or cancelling a stored response generates nothing: never queued or shed.
        prio = "critical" if route.by_id else gate.priority(environ.get("HTTP_X_LLMGW_PRIORITY") or None, key)
        trace.identify(model, key.name if key is not None else None, prio)
        tables = router.tables
        if not tables.loaded:
            raise not_loaded(self.not_ready())
        if key is not None:
            gate.enforce(key, model)  # expiry, the key's models, its budget: 401 / 404 / 429
            if key.budget:
                call.ask_for_usage()
        if model not in tables.known_models:
            # Unknown names get no per-name state and no metric label of their own (cardinality).
            self.metrics.rejected_unknown.inc()
            raise refusal(Rejection("unknown_model", model), RouteRequest(model), tables)
        if not route.by_id:
            router.requested(model)
        canon = environ["llmgw.model"] = tables.canonical.get(model, model)  # known: charts may count it
        call.adapter = tables.adapters.get(model) if tables.adapters else None  # a LoRA adapter's name
        call.plan_prefix(canon, tables.objectives.get(canon), self.cfg.routing.prefill_ms_per_token > 0)
        if not route.by_id:
            call.tenant = gate.tenant(environ, key)  # fair queueing: whom it is served for
        if key is not None:
            gate.limit(key, model)
        affinity = environ.get("HTTP_X_SESSION_ID") or call.affinity
        headers = forward_headers(environ, rid, call.data is not None)
        method = environ.get("REQUEST_METHOD", "POST")
        exclude: frozenset[str] = frozenset()
        last_error: ApiError | None = None
        attempt = 0
        while True:
            try:
                choice = self._admit(call, prio, affinity, exclude, attempt == 0, last_error, trace)
            except ApiError as e:
                trace.admitted(e.kind)
                raise
            trace.choice(choice.endpoint.id, choice.reason, choice.saturated)
            trace.admitted("send")
            self.queues.sent(call, choice)  # its tenant charged what it is expected to cost
            # From here the slot is ours: every path out of this block gives it back exactly once.
            lease = Lease(router, choice)
            resp = None
            try:
                ep = choice.endpoint
                path, out = call.request_for(ep)
                # The engine's credential, or an external server's own key (for this attempt only);
                # never the client's key (forward_headers drops it), never another endpoint's.
                secret = router.tables.api_keys.get(ep.id) or ep.engine_secret
                sent = {**headers, "authorization": f"Bearer {secret}"} if secret else headers
                trace.attempt(attempt, ep.id, ep.url + path)
                trace.inject(sent)  # the engine's parent: this attempt (tracing off: the client's, as sent)
                t_send = self.clock.monotonic()
                try:
                    resp = self.upstream.send(ep.url, path, out, sent, method)
                    router.answered(ep.id)
                    outcome = Outcome("answer", resp.status)
                except UpstreamConnectError as e:
                    log.warning("request %s: cannot reach %s (%s): %s", rid, ep.id, ep.url, e)
                    router.mark_unreachable(ep.id)
                    outcome = Outcome("connect_error")
                except UpstreamTimeout:
                    router.timed_out(ep.id)
                    outcome = Outcome("timeout")
                step = next_attempt(outcome, attempt, self.cfg.retries)
                if isinstance(step, Deliver):
                    answer = self.answers.respond(resp, lease, model, canon, key, rid, t0, t_send, route,
                                                  call.rewrite(ep), call.assembled(ep), trace=trace,
                                                  charge=call.charge)
                    lease, resp = None, None  # handed over: the answer releases them when it ends
                    return answer
                trace.attempt_failed(outcome.kind, outcome.status or None, not isinstance(step, GiveUp))
                if isinstance(step, GiveUp):
                    timed_out = step.kind == "upstream_timeout"
                    self.metrics.upstream_errors.labels(ep.id, "timeout" if timed_out else "connect").inc()
                    if timed_out:
                        self.metrics.requests.labels(model, ep.id, "504").inc()
                    raise attempt_failed(outcome, ep.id, model, self.cfg.first_byte_timeout, step)
                self.metrics.upstream_errors.labels(ep.id, step.reason).inc()
                self.metrics.retries.labels(model).inc()
                exclude = exclude | {ep.id}
                last_error = attempt_failed(outcome, ep.id, model, self.cfg.first_byte_timeout)
            finally:
                if resp is not None:
                    resp.close()
                if lease is not None:
                    lease.release()
            attempt += 1

    def _admit(self, call: Call, prio: str, affinity: str | None, exclude: frozenset[str], first: bool,
               last_error: ApiError | None, trace=NOOP_REQUEST) -> Choice:
        """A reserved endpoint for this attempt, after waiting in the model's queue if it must; else
        raises the refusal."""
        router, cfg = self.router, self.cfg
        q = self.queues.get(call.model)
        trace.admitting(len(q))
        req = RouteRequest(call.model, prio, affinity, exclude, len(q) + 1, op=call.route.op, pin=call.pin,
                           prefix=call.prefix, prompt_tokens=call.prompt_tokens, objective=call.objective,
                           body=call.body, opens=call.opens)
        res = router.route(req)
        if isinstance(res, Rejection) and res.kind == "unknown_model":
            timeout = router.tables.cold_start.get(req.model)
            if timeout is not None:
                return self._cold_start(req, q, timeout, call.client, trace)
        if isinstance(res, Rejection) and res.kind == NO_ADAPTER:
            return self._adapter_load(req, q, res, call.client, trace)
        # How long the queue would take to reach this request; only worth computing when it may wait.
        ahead = q.position(call.tenant) - 1 if len(q) else 0  # who leaves the queue before it, in fair order
        drain = (drain_time(ahead + 1, router.completion_rate(req.model))
                 if isinstance(res, Rejection) and res.kind == "saturated" else None)
        decision = admit(res, req.priority, ahead if first else 0, cfg.queue_max, cfg.queue_timeout, drain)
        if isinstance(decision, Wait):
            if isinstance(res, Choice):  # others queued first: give the slot back and line up
                router.release(res, None)
            self.saturation.queued(router.tables.canonical.get(req.model, req.model))
            entered = self.clock.monotonic()
            # Only the head of the queue routes: it is first in line, whatever waits behind it.
            res = self._wait(q, req, lambda: router.route(replace(req, queued=1, waited=self.clock.monotonic() - entered)),
                             cfg.queue_timeout, client=call.client, trace=trace, tenant=call.tenant)
            if res is None:
                self.metrics.shed.labels(req.model, "queue_timeout").inc()
                raise refusal(TimedOut(cfg.queue_timeout), req, router.tables)
            decision = res if isinstance(res, Rejection) else Send(res)
        if isinstance(decision, Send):
            return decision.choice
        if isinstance(decision, Shed):
            if isinstance(res, Choice):
                router.release(res, None)
            self.metrics.shed.labels(req.model, "saturated").inc()
        raise refusal(decision, req, router.tables, last_error=last_error)

    def _cold_start(self, req: RouteRequest, q: WaitQueue, timeout: float, client: ClientConn | None = None,
                    trace=NOOP_REQUEST) -> Choice:
        """The model has no endpoint and scales to zero: hold the request in its queue until a replica
        is published (gateway.routing.coldstart), telling the control plane at once."""
        decision = hold(timeout, len(q), self.cfg.queue_max)
        if isinstance(decision, Shed):
            self.metrics.shed.labels(req.model, "cold_start").inc()
            raise refusal(decision, req, self.router.tables, cold_start=timeout)
        model = self.router.tables.canonical.get(req.model, req.model)
        if self.demand.demand(model, len(q) + 1):
            log.info("model %s has no Ready replica: holding its requests up to %gs for a cold start", model, timeout)
        res = self._wait(q, req, lambda: self.router.route(replace(req, queued=1)), decision.timeout,
                         keep=("saturated", "unknown_model"), client=client, trace=trace)
        if isinstance(res, Choice):
            return res
        self.metrics.shed.labels(req.model, "cold_start_timeout").inc()
        raise refusal(TimedOut(decision.timeout), req, self.router.tables, cold_start=timeout)

    def _adapter_load(self, req: RouteRequest, q: WaitQueue, why: Rejection, client: ClientConn | None = None,
                      trace=NOOP_REQUEST) -> Choice:
        """No endpoint holds the adapter: hold the request until one has loaded it (the control plane
        is told at once), when one can (gateway.routing.adapters); else refuse with the reason."""
        route = self.router.tables.adapters[req.model]
        decision = load_hold(route, len(q), self.cfg.queue_max)
        if decision is None or isinstance(decision, Shed):
            self.metrics.shed.labels(req.model, "adapter_load").inc()
            raise refusal(decision or why, req, self.router.tables, adapter_load=route.wait)
        self.demand.demand(route.name, len(q) + 1)
        if route.can_cold_start and not route.servers:
            self.demand.demand(route.model, len(q) + 1)  # its model has no replica: start one
        res = self._wait(q, req, lambda: self.router.route(replace(req, queued=1)), decision.timeout,
                         keep=("saturated", "unknown_model", NO_ADAPTER), client=client, trace=trace)
        if isinstance(res, Choice):
            return res
        self.metrics.shed.labels(req.model, "adapter_load_timeout").inc()
        raise refusal(res or TimedOut(decision.timeout), req, self.router.tables, adapter_load=route.wait)

    def _wait(self, q: WaitQueue, req: RouteRequest, attempt: Callable[[], Choice | Rejection], timeout: float,
              keep: Collection[str] = ("saturated",), client: ClientConn | None = None,
              trace=NOOP_REQUEST, tenant=None) -> Choice | Rejection | None:
        """Wait in `q`; a client that leaves meanwhile takes its request out of the queue (never sent)."""
        gauge = self.metrics.queue.labels(req.model)
        gauge.inc()
        trace.queued(len(q) + 1)
        outcome = "left"  # an exception ends the wait: the client went away, or the worker stops
        try:
            res = q.wait(attempt, timeout, keep=keep, gone=client.gone if client else None,
                         watch=client.when_readable if client else None, tenant=tenant)
            outcome = queue_outcome(res)
        finally:
            gauge.dec()
            trace.dequeued(outcome)
        if res is GONE:
            self.metrics.client_gone.labels(req.model, "queued").inc()
            raise ApiError("client_gone", "the client closed its connection while the request was queued")
        return res

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
