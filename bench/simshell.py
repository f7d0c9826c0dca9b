"""What the simulators share (bench/fleetsim.py, bench/fairness.py): one gateway process's admission
shell, and one event loop on a virtual clock.

`GatewayShell` is gateway.http.proxy's shell around the same pure steps, on the simulator's clock:
the real `Router` (fed by the real `Pollers` and `Exchange`), `admission.decide` for each routing
result and `after_wait` for what a wait came to, and the queue in its fair order (the `Backlog` over
a `Ledger` that `WaitQueue` keeps, so a request without a tenant waits first come, first served).
Only the queue's head routes, and it tries again when a request ends or new loads arrive. A request
is charged when sent (`WaitQueues.sent`) and corrected by its answer's usage, as the proxy does.
tests/unit/test_admission_shells.py runs this shell, as each simulator sets it up, beside the proxy
on one trace.

`EventLoop` pops timed events in order (time, then the order they were scheduled in) and hands each
kind to its `on_<kind>` method; the events every simulation has (arrivals, engine steps, scrapes,
the gateways' polls, queue timeouts, the gateways' exchange of what they sent and hold) are handled
here, the rest by the simulation.
"""

from __future__ import annotations

import heapq
import random
from types import SimpleNamespace
from typing import Callable, Protocol, Sequence

from gateway.config import GatewaySettings
from gateway.routing.admission import (Queue, Request, Send, Settings, after_wait, answered_as_shed, decide,
                                       needs_rate, needs_restart)
from gateway.routing.choice import COMPLETION, FIRST_TOKEN, Choice, Rejection, RouteRequest
from gateway.routing.exchange import Exchange
from gateway.routing.inflight import InFlight
from gateway.routing.ledger import NO_TENANT, Backlog, Ledger
from gateway.routing.queue import WaitQueues
from gateway.routing.retry import Deliver, GiveUp, Outcome, next_attempt
from gateway.routing.router import Router
from gateway.server.pollers import Pollers
from llmgw.state.clock import Clock
from llmgw.state.records import EndpointInfo
from llmgw.surface import CHAT

MODEL = "m"  # the one model every simulated fleet serves


class SimClock(Clock):
    def __init__(self):
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


class Peer(Protocol):
    """A router modelled in place of llmgw's (bench/fleetsim.py's MODELLED): one per gateway process.
    It places each request among the listed endpoints, and is told when one leaves its engine."""

    def choose(self, req, endpoints: Sequence[EndpointInfo]) -> Choice: ...

    def release(self, endpoint_id: str) -> None: ...


def gateway_parts(store, cfg: GatewaySettings, clock: Clock, shares_sends: bool) -> tuple[Router, Exchange, Pollers]:
    """One gateway process's routing parts as gateway.app makes them (alone: no sibling workers), with
    the endpoint list read once. `shares_sends`: it keeps what it sends for the other gateways."""
    counts = InFlight(outbox=shares_sends)
    router = Router(cfg.routing, clock, random.Random(cfg.seed), counts)
    exchange = Exchange(counts, lambda: router.tables, clock, says_holds=cfg.routing.policy == "llmgw")
    pollers = Pollers(store, cfg, router)
    pollers.refresh_endpoints()
    return router, exchange, pollers


class GatewayShell:
    """One gateway process (module docstring). `sim` is the simulation: its `cfg`, `now`, `at`, `finish`,
    `engines` and `fleet`. `peer`: makes this gateway's modelled router, which then places every
    request instead (no admission, no learning). `drain_on_join`: a request that joins the queue routes again at once when it is the
    head (the proxy's `WaitQueue.wait` does); bench/fleetsim.py's figures were taken without it."""

    def __init__(self, sim, idx: int, router: Router, pollers: Pollers | None = None,
                 exchange: Exchange | None = None, ledger: Ledger | None = None,
                 peer: Callable[["GatewayShell"], Peer] | None = None, drain_on_join: bool = False):
        self.sim, self.idx, self.router, self.pollers, self.exchange = sim, idx, router, pollers, exchange
        self.ledger = ledger if ledger is not None else Ledger()
        self.queue: Backlog = Backlog()
        self.queues = WaitQueues(sim.cfg.queue_max, ledger=self.ledger)  # its `sent`: what a request is charged
        self.drain_on_join = drain_on_join
        self.peer = peer(self) if peer is not None else None

    # gateway.http.proxy.Proxy._admit, on the simulator's clock: the same pure step, carried out here
    def admit(self, req) -> None:
        if self.peer is not None:
            self.send(req, self.peer.choose(req, self.router.endpoints))
            return
        cfg, router, queue = self.sim.cfg, self.router, self.queue
        tenant = req.tenant or NO_TENANT
        res = router.route(self.request(req, len(queue) + 1))
        # Who leaves the queue before it, in fair order (gateway.routing.fairness): its place in line.
        ahead = queue.position(tenant, self.ledger.fcfs) - 1 if queue else 0
        step = decide(res, ahead, Request(req.priority, MODEL, req.attempt == 0,
                                          router.completion_rate(MODEL) if needs_rate(res) else None,
                                          restart=(cfg.restart_hold or None) if needs_restart(res) else None),
                      Settings(cfg.queue_max, cfg.queue_timeout))
        if isinstance(step, Queue):
            if step.give_back:
                router.release(res, None)
            req.deadline, req.waiting, req.queued_at = self.sim.now + step.timeout, step, self.sim.now
            queue.push(tenant, req, self.ledger, MODEL)
            req.in_queue = True
            self.sim.at(req.deadline, "timeout", (self, req))
            if self.drain_on_join:
                self.drain()
            return
        self.carry_out(req, step, res)

    def carry_out(self, req, step, res=None) -> None:
        """Send, or end the request as shed (a Shed, a wait that timed out) or failed (a rejection)."""
        if isinstance(step, Send):
            self.send(req, step.choice)
            return
        if step.give_back:
            self.router.release(res, None)
        self.sim.finish(req, "shed" if answered_as_shed(step) else "error")

    def drain(self) -> None:
        """The queue's head routes while endpoints free (WaitQueue.wait's loop)."""
        queue, now = self.queue, self.sim.now
        while queue:
            head = queue.head(self.ledger, MODEL)
            res = self.router.route(self.request(head, 1, waited=now - head.arrival))
            if isinstance(res, Rejection) and res.kind in head.waiting.keep:
                return
            self._leave(head)
            self.carry_out(head, after_wait(res, head.waiting))

    def timeout(self, req) -> None:
        if req.in_queue and self.sim.now >= req.deadline:
            self._leave(req)
            self.carry_out(req, after_wait(None, req.waiting))

    def _leave(self, req) -> None:
        tenant = req.tenant or NO_TENANT
        self.queue.remove(tenant, req)
        req.in_queue = False
        self.ledger.waited(MODEL, tenant, self.sim.now - req.queued_at)

    @staticmethod
    def request(req, queued: int, waited: float = 0.0) -> RouteRequest:
        """The RouteRequest gateway.http.proxy builds: a conversation's turn is a streamed chat
        request, so it carries its prompt's block keys and minimises its first token."""
        return RouteRequest(MODEL, req.priority, None, req.exclude, queued, waited=waited, prefix=req.keys,
                            prompt_tokens=req.prompt_estimate, objective=FIRST_TOKEN if req.keys else COMPLETION,
                            opens=req.opens)

    def send(self, req, choice: Choice) -> None:
        sim = self.sim
        req.choice, req.sent, req.endpoint = choice, sim.now, choice.endpoint.id
        if req.tenant is not None and req.charge is None:
            # What gateway.http.attempt hands WaitQueues.sent (once per request): a streamed chat request
            # without max_tokens, and its plan's tenant and prompt.
            call = SimpleNamespace(model=MODEL, body={"stream": True}, data=None, route=SimpleNamespace(op=CHAT))
            req.charge = self.queues.sent(call, SimpleNamespace(tenant=req.tenant, prompt_tokens=float(req.prompt)),
                                          choice)
        eng = sim.engines[choice.endpoint.id]
        if eng.dead(sim.now):
            self.release(req, ok=False)
            if self.peer is None:
                self.router.mark_unreachable(choice.endpoint.id)
            step = next_attempt(Outcome("connect_error"), req.attempt, sim.cfg.retries)
            if isinstance(step, GiveUp):
                sim.finish(req, "error")
                return
            req.attempt += 1
            req.exclude = req.exclude | {choice.endpoint.id}
            self.admit(req)
            return
        assert isinstance(next_attempt(Outcome("answer", 200), req.attempt, sim.cfg.retries), Deliver)
        eng.submit(req, sim.now)

    def release(self, req, ok: bool) -> None:
        """The request left its engine (`ok`: answered whole)."""
        if self.peer is not None:
            self.peer.release(req.choice.endpoint.id)
            return
        sim, now = self.sim, self.sim.now
        if ok and req.charge is not None:
            req.charge.done((req.prompt, req.output))  # the answer's usage
        if ok and req.keys and sim.fleet.make == "llamacpp":
            # llama-server's answer says how much of its prompt it reused (timings.cache_n), which
            # gateway.http.answer hands to the router
            self.router.reused(req.endpoint, req.prompt, req.cached)
        tokens = req.output if (ok and sim.fleet.usage) else None
        ttfb = (req.first - req.sent) if (ok and req.first is not None) else None
        self.router.release(req.choice, (now - req.sent) if ok else None, tokens, ttfb)
        self.drain()

    def poll(self) -> None:
        """A load refresh (gateway.server.pollers), after which the queue's head looks again. Modelled
        peers read no loads."""
        if self.peer is None:
            self.pollers.refresh_loads()
            self.drain()


class EventLoop:
    """Timed events on the simulation's clock (module docstring). A simulation sets `cfg`, `store`,
    `engines`, `gateways` (GatewayShell), `scrape` and `load_interval` (seconds), and counts the
    requests not finished yet in `pending`: the loop ends when none is left."""

    cfg: GatewaySettings
    scrape: float
    load_interval: float

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list = []
        self._seq = 0
        self.clock = SimClock()
        self.pending = 0

    def at(self, t: float, kind: str, payload) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    def loop(self, end: float) -> None:
        """Until every request finished or the clock passes `end`."""
        handlers: dict[str, Callable] = {}
        while self.events and self.pending:
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = self.clock.now = t
            if t > end:
                break
            handle = handlers.get(kind)
            if handle is None:
                handle = handlers[kind] = getattr(self, "on_" + kind)
            handle(t, payload)

    def on_arrival(self, t: float, req) -> None:
        self.gateways[req.gateway].admit(req)

    def on_step(self, t: float, payload) -> None:
        engine, step, gen = payload
        engine.step_done(step, gen)

    def on_scrape(self, t: float, engine) -> None:
        """The agent writes the engine's LoadRecord (its /metrics as scraped now)."""
        self.store.records[engine.spec.name] = engine.record(t)
        self.at(t + self.scrape, "scrape", engine)

    def on_poll(self, t: float, gw: GatewayShell) -> None:
        gw.poll()
        self.at(t + self.load_interval, "poll", gw)

    def on_timeout(self, t: float, payload) -> None:
        gw, req = payload
        gw.timeout(req)

    def on_sends(self, t: float, gw: GatewayShell) -> None:
        """A flush to Redis of what `gw` sent and holds, read at once by the others' waiting reads
        (gateway.server.sendshare), every LLMGW_GATEWAY_SHARE_SENDS."""
        sends, holds = gw.exchange.take_sends(), gw.exchange.take_holds()
        for other in self.gateways:
            if other is not gw:
                other.exchange.learn_sends(sends)
                if holds is not None:
                    other.exchange.learn_holds(str(gw.idx), holds, t)
        self.at(t + self.cfg.share_sends, "sends", gw)
