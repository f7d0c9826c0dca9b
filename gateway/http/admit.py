"""Admission's shell: route one attempt of a request, ask the pure `gateway.routing.admission.decide`
what to do with the result, and carry it out: send, wait in the model's queue (in fair order by
tenant, gateway.routing.queue), or raise the refusal (worded by gateway.http.refusal).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Callable, Collection

from gateway.config import GatewaySettings
from gateway.errors import ApiError
from gateway.http.refusal import refused
from gateway.observe.demand import DemandSignal
from gateway.observe.metrics import Metrics
from gateway.observe.saturation import SaturationSignals
from gateway.observe.tracing import queue_outcome
from gateway.request.call import Call, salted
from gateway.request.client import ClientConn
from gateway.request.plan import Plan
from gateway.routing.adapters import Lift
from gateway.http.evictions import Evictions
from gateway.routing.admission import (COLD_START, RESUMING, SATURATED, Queue, Request, Send, Settings, after_wait,
                                       decide, needs_rate, needs_restart)
from gateway.routing.eviction import Evict
from gateway.routing.choice import Choice, Rejection, RouteRequest
from gateway.routing.queue import GONE, WaitQueue, WaitQueues
from gateway.routing.router import Router
from gateway.routing import slo as targets
from llmgw.state.clock import Clock
from llmgw.state.keypolicy import PRIORITY_RANK
from llmgw.tracing import NOOP_REQUEST

log = logging.getLogger("llmgw.gateway")


class Admission:
    """Admits attempts of requests to this gateway process's endpoints."""

    def __init__(self, cfg: GatewaySettings, clock: Clock, router: Router, queues: WaitQueues, metrics: Metrics,
                 saturation: SaturationSignals, demand: DemandSignal, evictions: Evictions | None = None):
        self.cfg, self.clock, self.router, self.queues, self.metrics = cfg, clock, router, queues, metrics
        self.saturation, self.demand = saturation, demand
        # Running answers a request that ranks first may evict (gateway.http.evictions; None: none).
        self.evictions = evictions if evictions is not None and evictions.enabled else None
        self.settings = Settings(cfg.queue_max, cfg.queue_timeout, cfg.total_timeout)

    def admit(self, call: Call, plan: Plan, exclude: frozenset[str], first: bool, last_error: ApiError | None,
              trace=NOOP_REQUEST, failed_at: dict[str, str] | None = None, continuation: bool = False,
              arrived: float | None = None) -> Choice:
        """A reserved endpoint for this attempt, after waiting in the model's queue if admission says
        so; else raises the refusal. `failed_at`: the address each excluded endpoint failed at;
        `continuation`: it continues an answer that began (admission.Request.continuation); `arrived`:
        when its request arrived (monotonic), its place among the other workers' waiting requests."""
        router, tables = self.router, self.router.tables
        q = self.queues.get(call.model)
        trace.admitting(len(q))
        slo = (targets.slo_of(plan.targets, self.clock.monotonic() - arrived if arrived is not None else 0.0,
                              call.stream) if plan.targets else None)
        # The other workers' waiting requests count as this worker's: a slot that frees goes to the one
        # that ranks first among all of them, not to whichever request routes first (gateway.server.board).
        elsewhere = q.elsewhere()
        req = RouteRequest(call.model, plan.priority, plan.affinity, exclude, len(q) + elsewhere + 1, op=call.route.op,
                           pin=call.pin, prefix=plan.prefix, prompt_tokens=plan.prompt_tokens,
                           objective=plan.objective, body=salted(call.body, plan.cache_salt), opens=plan.opens,
                           slo=slo, continuation=continuation)
        res = router.route(req)
        # Who leaves the queue before it, in fair order (gateway.routing.fairness), or by its due time when
        # its latency target is near (gateway.routing.slo.due): its place in line.
        due = targets.due(arrived, plan.targets) if slo is not None and arrived is not None else math.inf
        ahead = q.position(plan.tenant, due) - 1 if len(q) else 0
        canon = plan.canon
        rate = router.completion_rate(req.model) if needs_rate(res) else None
        restart = (self.cfg.restart_hold or None) if needs_restart(res) and router.had_replica(canon) else None
        displaces = (self.evictions is not None and needs_rate(res) and not continuation
                     and isinstance(self.evictions.decide(call, plan, tables, exclude,
                                                          targets.slack(slo, 0.0, res, rate) if slo else None), Evict))
        step = decide(res, ahead, Request(plan.priority, canon, first, rate, cold_start=tables.cold_start.get(req.model),
                                          restart=restart, adapter=plan.adapter, continuation=continuation,
                                          displaces=displaces, elsewhere=elsewhere), self.settings)
        if slo is not None:  # its latency targets: refused at once, or waiting no longer than they allow
            step = targets.admit(step, res, slo, ahead + 1, rate)
        if isinstance(step, Queue):
            step = self._queue(step, res, q, req, call, plan, trace, failed_at, arrived)
        if isinstance(step, Send):
            return step.choice
        if step.give_back:
            router.release(res, None)
        if step.shed:
            self.metrics.shed.labels(req.model, step.shed).inc()
        raise refused(step, req, router.tables, last_error)

    def _queue(self, step: Queue, res: Choice | Rejection, q: WaitQueue, req: RouteRequest, call: Call,
               plan: Plan, trace, failed_at: dict[str, str] | None, arrived: float | None):
        """Wait in the model's queue as `step` says; what the wait came to (admission.after_wait). While
        it is first in line and its model saturated, it may evict a running answer it outranks."""
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
        evictions, pending = self.evictions, set()  # (the answers it evicted that still hold their slot)

        def again() -> Choice | Rejection:
            exclude = lift(router.tables.by_id)
            # (a slot another gateway paused one of its answers for, for this request: gateway.routing.remote_eviction)
            granted = evictions.granted(call.model, pending) if evictions is not None else None
            got = router.route(replace(req, queued=1, waited=self.clock.monotonic() - entered, exclude=exclude,
                                       granted=granted))
            if evictions is not None and isinstance(got, Rejection) and got.kind == SATURATED and step.why != RESUMING:
                slack = (targets.slack(req.slo, self.clock.monotonic() - entered, got, router.completion_rate(req.model))
                         if req.slo is not None else None)
                soon = evictions.consider(call, plan, router.tables, exclude, pending, slack)
                if soon is not None and (got.retry_in is None or soon < got.retry_in):
                    got = replace(got, retry_in=max(0.001, soon))  # look again when it may evict
            return got

        due = targets.due(arrived, plan.targets) if req.slo is not None and arrived is not None else math.inf
        try:
            got = self._wait(q, req, again, step.timeout, step.keep, call.client, trace, plan.tenant, step.head,
                             arrived, due)
        finally:
            if evictions is not None:
                evictions.withdraw(call.model, pending)  # its ask to the other gateways ends with its wait
        if req.slo is not None:
            return targets.after_wait(after_wait(got, step), req.slo, step, self.settings.queue_timeout)
        return after_wait(got, step)

    def _wait(self, q: WaitQueue, req: RouteRequest, attempt: Callable[[], Choice | Rejection], timeout: float,
              keep: Collection[str], client: ClientConn, trace, tenant, head: bool,
              arrived: float | None, due: float = math.inf) -> Choice | Rejection | None:
        """Wait in `q`; a client that leaves meanwhile takes its request out of the queue (never sent)."""
        gauge = self.metrics.queue.labels(req.model)
        gauge.inc()
        trace.queued(len(q) + 1)
        outcome = "left"  # an exception ends the wait: the client went away, or the worker stops
        try:
            res = q.wait(attempt, timeout, keep=keep, gone=client.gone, watch=client.when_readable, tenant=tenant,
                         head=head, rank=PRIORITY_RANK.get(req.priority, 1), arrived=arrived, due=due)
            outcome = queue_outcome(res)
        finally:
            gauge.dec()
            trace.dequeued(outcome)
        if res is GONE:
            self.metrics.client_gone.labels(req.model, "queued").inc()
            raise ApiError("client_gone", "the client closed its connection while the request was queued")
        return res
