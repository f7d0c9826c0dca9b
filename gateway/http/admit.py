"""Admission's shell: route one attempt of a request, ask the pure `gateway.routing.admission.decide`
what to do with the result, and carry it out: send, wait in the model's queue (in fair order by
tenant, gateway.routing.queue), or raise the refusal (worded by gateway.http.refusal).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Collection

from gateway.config import GatewaySettings
from gateway.errors import ApiError
from gateway.http.refusal import refused
from gateway.observe.demand import DemandSignal
from gateway.observe.metrics import Metrics
from gateway.observe.saturation import SaturationSignals
from gateway.observe.tracing import queue_outcome
from gateway.request.call import Call
from gateway.request.client import ClientConn
from gateway.request.plan import Plan
from gateway.routing.adapters import Lift
from gateway.routing.admission import (COLD_START, SATURATED, Queue, Request, Send, Settings, after_wait, decide,
                                       needs_rate, needs_restart)
from gateway.routing.choice import Choice, Rejection, RouteRequest
from gateway.routing.queue import GONE, WaitQueue, WaitQueues
from gateway.routing.router import Router
from llmgw.state.clock import Clock
from llmgw.tracing import NOOP_REQUEST

log = logging.getLogger("llmgw.gateway")


class Admission:
    """Admits attempts of requests to this gateway process's endpoints."""

    def __init__(self, cfg: GatewaySettings, clock: Clock, router: Router, queues: WaitQueues, metrics: Metrics,
                 saturation: SaturationSignals, demand: DemandSignal):
        self.cfg, self.clock, self.router, self.queues, self.metrics = cfg, clock, router, queues, metrics
        self.saturation, self.demand = saturation, demand
        self.settings = Settings(cfg.queue_max, cfg.queue_timeout)

    def admit(self, call: Call, plan: Plan, exclude: frozenset[str], first: bool, last_error: ApiError | None,
              trace=NOOP_REQUEST, failed_at: dict[str, str] | None = None) -> Choice:
        """A reserved endpoint for this attempt, after waiting in the model's queue if admission says
        so; else raises the refusal. `failed_at`: the address each excluded endpoint failed at."""
        router, tables = self.router, self.router.tables
        q = self.queues.get(call.model)
        trace.admitting(len(q))
        req = RouteRequest(call.model, plan.priority, plan.affinity, exclude, len(q) + 1, op=call.route.op,
                           pin=call.pin, prefix=plan.prefix, prompt_tokens=plan.prompt_tokens,
                           objective=plan.objective, body=call.body, opens=plan.opens)
        res = router.route(req)
        # Who leaves the queue before it, in fair order (gateway.routing.fairness): its place in line.
        ahead = q.position(plan.tenant) - 1 if len(q) else 0
        canon = plan.canon
        rate = router.completion_rate(req.model) if needs_rate(res) else None
        restart = (self.cfg.restart_hold or None) if needs_restart(res) and router.had_replica(canon) else None
        step = decide(res, ahead, Request(plan.priority, canon, first, rate, cold_start=tables.cold_start.get(req.model),
                                          restart=restart, adapter=plan.adapter), self.settings)
        if isinstance(step, Queue):
            step = self._queue(step, res, q, req, call.client, plan, trace, failed_at)
        if isinstance(step, Send):
            return step.choice
        if step.give_back:
            router.release(res, None)
        if step.shed:
            self.metrics.shed.labels(req.model, step.shed).inc()
        raise refused(step, req, router.tables, last_error)

    def _queue(self, step: Queue, res: Choice | Rejection, q: WaitQueue, req: RouteRequest, client: ClientConn,
               plan: Plan, trace, failed_at: dict[str, str] | None):
        """Wait in the model's queue as `step` says; what the wait came to (admission.after_wait)."""
        router, tables = self.router, self.router.tables
        if step.give_back:  # others queued first: give the slot back and line up
            router.release(res, None)
        if step.why == SATURATED:
            self.saturation.queued(plan.canon)
        for name in step.demand:
            if self.demand.demand(name, len(q) + 1) and step.why == COLD_START:
                log.info("model %s has no Ready replica: holding its requests up to %gs for a cold start",
                         name, step.timeout)
        entered = self.clock.monotonic()
        # Only the head of the queue routes: it is first in line, whatever waits behind it. A failed
        # endpoint counts again once its engine restarted (left the list, or is listed at another
        # address than the one it failed at).
        lift = Lift(req.exclude, tables.by_id, failed_at or {})
        again = lambda: router.route(replace(req, queued=1, waited=self.clock.monotonic() - entered,  # noqa: E731
                                             exclude=lift(router.tables.by_id)))
        got = self._wait(q, req, again, step.timeout, step.keep, client, trace, plan.tenant)
        return after_wait(got, step)

    def _wait(self, q: WaitQueue, req: RouteRequest, attempt: Callable[[], Choice | Rejection], timeout: float,
              keep: Collection[str], client: ClientConn, trace, tenant) -> Choice | Rejection | None:
        """Wait in `q`; a client that leaves meanwhile takes its request out of the queue (never sent)."""
        gauge = self.metrics.queue.labels(req.model)
        gauge.inc()
        trace.queued(len(q) + 1)
        outcome = "left"  # an exception ends the wait: the client went away, or the worker stops
        try:
            res = q.wait(attempt, timeout, keep=keep, gone=client.gone, watch=client.when_readable, tenant=tenant)
            outcome = queue_outcome(res)
        finally:
            gauge.dec()
            trace.dequeued(outcome)
        if res is GONE:
            self.metrics.client_gone.labels(req.model, "queued").inc()
            raise ApiError("client_gone", "the client closed its connection while the request was queued")
        return res
