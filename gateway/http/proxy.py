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
from gateway.http.refusal import attempt_failed, not_loaded, refused, refusal
from gateway.http.resume import Resender
from gateway.keys.gate import KeyGate
from gateway.observe.demand import DemandSignal
from gateway.observe.metrics import Metrics
from gateway.observe.saturation import SaturationSignals
from gateway.observe.tracing import queue_outcome, route_path
from gateway.observe.traffic import TrafficCounter
from gateway.request.call import Call, forward_headers, read_call
from gateway.request.client import ClientConn
from gateway.request.surface import Route
from gateway.routing.adapters import Lift
from gateway.routing.admission import (COLD_START, SATURATED, Queue, Request, Send, Settings, after_wait, decide,
                                       needs_rate, needs_restart)
from gateway.routing.choice import Choice, Rejection, RouteRequest
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
        self.admission = Settings(cfg.queue_max, cfg.queue_timeout)

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
        failed_at: dict[str, str] = {}  # endpoint -> the address it failed at
        last_error: ApiError | None = None
        attempt = 0
        while True:
            try:
                choice = self._admit(call, prio, affinity, exclude, attempt == 0, last_error, trace, failed_at)
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
                    resp = self.upstream.send(ep.url, path, out, sent, method, watch=call.client)
                    router.answered(ep.id)
                    outcome = Outcome("answer", resp.status)
                except UpstreamConnectError as e:
                    if call.client.gone():  # it left while the engine worked: not the engine's failure
                        self.metrics.client_gone.labels(model, "answering").inc()
                        raise ApiError("client_gone", f"the client left while endpoint {ep.id} answered") from None
                    log.warning("request %s: cannot reach %s (%s): %s", rid, ep.id, ep.url, e)
                    router.mark_unreachable(ep.id)
                    outcome = Outcome("connect_error")
                except UpstreamTimeout:
                    router.timed_out(ep.id)
                    outcome = Outcome("timeout")
                step = next_attempt(outcome, attempt, self.cfg.retries)
                if isinstance(step, Deliver):
                    # After the first byte the answer may move to another endpoint (gateway.http.resume).
                    readmit = lambda c, ex: self._admit(c, prio, affinity, ex, False, None, trace)  # noqa: E731
                    resend = Resender(router, self.upstream, readmit, call, headers, method, self.cfg, self.metrics,
                                      trace, rid)
                    answer = self.answers.respond(resp, lease, model, canon, key, rid, t0, t_send, route,
                                                  call.rewrite(ep), call.assembled(ep), trace=trace, resend=resend,
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
                failed_at[ep.id] = ep.url
                last_error = attempt_failed(outcome, ep.id, model, self.cfg.first_byte_timeout)
            finally:
                if resp is not None:
                    resp.close()
                if lease is not None:
                    lease.release()
            attempt += 1

    def _admit(self, call: Call, prio: str, affinity: str | None, exclude: frozenset[str], first: bool,
               last_error: ApiError | None, trace=NOOP_REQUEST, failed_at: dict[str, str] | None = None) -> Choice:
        """A reserved endpoint for this attempt, after waiting in the model's queue if admission says
        so (gateway.routing.admission.decide); else raises the refusal."""
        router, tables = self.router, self.router.tables
        q = self.queues.get(call.model)
        trace.admitting(len(q))
        req = RouteRequest(call.model, prio, affinity, exclude, len(q) + 1, op=call.route.op, pin=call.pin,
                           prefix=call.prefix, prompt_tokens=call.prompt_tokens, objective=call.objective,
                           body=call.body, opens=call.opens)
        res = router.route(req)
        # Who leaves the queue before it, in fair order (gateway.routing.fairness): its place in line.
        ahead = q.position(call.tenant) - 1 if len(q) else 0
        canon = tables.canonical.get(req.model, req.model)
        rate = router.completion_rate(req.model) if needs_rate(res) else None
        restart = (self.cfg.restart_hold or None) if needs_restart(res) and router.had_replica(canon) else None
        step = decide(res, ahead, Request(prio, canon, first, rate, cold_start=tables.cold_start.get(req.model),
                                          restart=restart, adapter=call.adapter), self.admission)
        if isinstance(step, Queue):
            if step.give_back:  # others queued first: give the slot back and line up
                router.release(res, None)
            if step.why == SATURATED:
                self.saturation.queued(canon)
            for name in step.demand:
                if self.demand.demand(name, len(q) + 1) and step.why == COLD_START:
                    log.info("model %s has no Ready replica: holding its requests up to %gs for a cold start",
                             name, step.timeout)
            entered = self.clock.monotonic()
            # Only the head of the queue routes: it is first in line, whatever waits behind it.
            # A failed endpoint counts again once its engine restarted (left the list, or is listed at
            # another address than the one it failed at).
            lift = Lift(req.exclude, tables.by_id, failed_at)
            got = self._wait(q, req, lambda: router.route(replace(req, queued=1, waited=self.clock.monotonic() - entered,
                                                                  exclude=lift(router.tables.by_id))),
                             step.timeout, keep=step.keep, client=call.client, trace=trace, tenant=call.tenant)
            step = after_wait(got, step)
        if isinstance(step, Send):
            return step.choice
        if step.give_back:
            router.release(res, None)
        if step.shed:
            self.metrics.shed.labels(req.model, step.shed).inc()
        raise refused(step, req, router.tables, last_error)

    def _wait(self, q: WaitQueue, req: RouteRequest, attempt: Callable[[], Choice | Rejection], timeout: float,
              keep: Collection[str] = (SATURATED,), client: ClientConn | None = None,
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
