"""The gateway's proxy and the simulators (bench/fleetsim.py, bench/fairness.py: one shell,
bench/simshell.py, as each sets it up) carry out the same admission step: one trace of routing
results, queue lengths and attempts through every shell, every decision and what each shell then did
compared. A shell that passed `decide` something else (the queue length of a retry, a drain rate, a
priority) or acted otherwise on its verdict (kept a slot it should give back, queued a request it
should refuse) fails here, so no simulator can drift from the gateway again."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import bench.fairness as fairness
import bench.fleetsim as fleetsim
import bench.simshell as simshell
import gateway.http.admit as admit_mod
from gateway.config import GatewaySettings
from gateway.errors import ApiError
from gateway.http.admit import Admission
from gateway.observe.metrics import Metrics
from gateway.observe.saturation import SaturationSignals
from gateway.request.call import Call
from gateway.request.plan import Plan
from gateway.request.surface import ROUTES
from gateway.routing import admission
from gateway.routing.choice import Choice, Rejection
from gateway.routing.ledger import NO_TENANT, Ledger
from gateway.routing.queue import Ticket, WaitQueues
from gateway.routing.tables import EMPTY
from llmgw.state.keypolicy import Tenant
from llmgw.state.records import EndpointInfo
from llmgw.surface import CHAT
from tests.support.clock import FakeClock

EP = EndpointInfo(id="a", url="http://a", models=("m",), engine="sim", model="m")
OK = Choice(EP, 0.1, 0)
SAT = Rejection("saturated", "m")
NONE_READY = Rejection("no_ready", "m")

# (requests already waiting, priority, first attempt, routing result, the fleet's completion rate)
TRACE = [
    (0, "standard", True, OK, 2.0),
    (3, "standard", True, OK, 2.0),  # the router weighed the queue: sent
    (3, "sheddable", True, OK, 2.0),  # standard requests wait: shed, its slot given back
    (0, "sheddable", True, SAT, 2.0),
    (0, "standard", True, SAT, 2.0),  # queued
    (5, "standard", True, SAT, 2.0),
    (20, "standard", True, SAT, 2.0),  # would drain in 10.5 s, over the 8 s bound: shed at once
    (20, "standard", False, SAT, 2.0),  # a retry does not line up behind the queue: queued
    (20, "standard", True, SAT, None),  # no rate learned yet: queued
    (64, "standard", True, SAT, 2.0),  # queue full
    (0, "critical", True, SAT, 2.0),
    (2, "critical", True, OK, 2.0),
    (0, "standard", True, NONE_READY, 2.0),  # every endpoint failed it: it waits for one to come back
    (0, "standard", True, Rejection("unsupported", "m"), 2.0),  # not admission's business: refused as it is
]
QUEUE_MAX, QUEUE_TIMEOUT = 64, 8.0


class ScriptedRouter:
    """Returns the trace's result; records what was given back."""

    def __init__(self, result, rate):
        self.result, self.rate, self.released = result, rate, []
        self.tables = EMPTY.tables

    def route(self, req):
        return self.result

    def completion_rate(self, model):
        return self.rate

    def had_replica(self, model):
        return True  # the model's replicas were listed (a restart, not a model never placed)

    def release(self, choice, service_time):
        self.released.append(choice)


def recorded(monkeypatch, module) -> list:
    calls = []
    real = admission.decide

    def decide(result, queued, req, cfg):
        verdict = real(result, queued, req, cfg)
        calls.append((result, queued, req.priority, req.first, req.rate, cfg, verdict))
        return verdict

    monkeypatch.setattr(module, "decide", decide)
    return calls


def through_proxy(monkeypatch, waiting, prio, first, result, rate) -> tuple[list, str, int]:
    calls = recorded(monkeypatch, admit_mod)
    router = ScriptedRouter(result, rate)
    clock = FakeClock(0.0)
    queues = WaitQueues(QUEUE_MAX, clock.monotonic)
    q = queues.get("m")
    for _ in range(waiting):  # others of the same tenant wait ahead (one FIFO: the simulator's order)
        q.waiters.push(NO_TENANT, Ticket(), q.ledger, "m")
    cfg = GatewaySettings(queue_max=QUEUE_MAX, queue_timeout=QUEUE_TIMEOUT)
    demand = SimpleNamespace(demand=lambda name, n: False)
    a = Admission(cfg, clock, router, queues, Metrics(), SaturationSignals(), demand)
    waited = []
    monkeypatch.setattr(a, "_wait", lambda q, req, attempt, timeout, *args: waited.append(timeout))  # times out
    call = Call(ROUTES[CHAT], "m")
    try:
        got = a.admit(call, Plan("m", prio), frozenset(), first, None)
        outcome = "sent" if got is result else "?"
    except ApiError as e:
        outcome = ("queued, then " if waited else "") + ("shed" if e.kind == "shed" else "error")
    return calls, outcome, len(router.released)


def through_simulator(monkeypatch, make, tenant, waiting, prio, first, result, rate) -> tuple[list, str, int]:
    """The trace's row through a simulator's gateway shell, made by `make(sim, router)` as the
    simulator makes it, for requests of `tenant` (None: no key)."""
    calls = recorded(monkeypatch, simshell)
    router = ScriptedRouter(result, rate)
    ends, timers = [], []
    sim = SimpleNamespace(cfg=GatewaySettings(queue_max=QUEUE_MAX, queue_timeout=QUEUE_TIMEOUT), now=0.0,
                          policy="llmgw", rng=random.Random(1), at=lambda t, kind, payload: timers.append(payload),
                          finish=lambda req, status: ends.append(status))
    gw = make(sim, router)
    for i in range(waiting):  # others of the same tenant wait ahead (one FIFO, as in the proxy's queue)
        ahead = fleetsim.Req(rid=100 + i, arrival=0.0, prompt=8, output=8, priority="standard", gateway=0,
                             tenant=tenant, waiting=admission.Queue(QUEUE_TIMEOUT, admission.SATURATED))
        gw.queue.push(tenant or NO_TENANT, ahead, gw.ledger, "m")
    sent = []
    gw.send = lambda req, choice: sent.append(choice)
    req = fleetsim.Req(rid=1, arrival=0.0, prompt=8, output=8, priority=prio, gateway=0, attempt=0 if first else 1,
                       tenant=tenant)
    gw.admit(req)
    outcome = "sent" if sent == [result] else "?"
    if timers:  # queued: its wait runs out
        sim.now = req.deadline
        gw.timeout(req)
        outcome = "queued, then " + ends[-1]
    elif ends:
        outcome = ends[-1]
    return calls, outcome, len(router.released)


SHELLS = {
    "fleetsim": lambda mp, *row: through_simulator(mp, lambda sim, r: fleetsim.gateway_shell(sim, 0, r), None, *row),
    "fairness": lambda mp, *row: through_simulator(
        mp, lambda sim, r: fairness.gateway_shell(sim, 0, r, Ledger()), Tenant("k-a", "a", 2.0), *row),
}


@pytest.mark.parametrize("shell", list(SHELLS))
@pytest.mark.parametrize("waiting, prio, first, result, rate", TRACE)
def test_the_proxy_and_each_simulator_decide_and_act_alike(monkeypatch, shell, waiting, prio, first, result, rate):
    p_calls, p_outcome, p_given_back = through_proxy(monkeypatch, waiting, prio, first, result, rate)
    s_calls, s_outcome, s_given_back = SHELLS[shell](monkeypatch, waiting, prio, first, result, rate)
    assert p_calls == s_calls and len(p_calls) == 1
    assert (p_outcome, p_given_back) == (s_outcome, s_given_back)
    assert "?" not in p_outcome


def test_the_trace_covers_every_verdict(monkeypatch):
    """The trace is worth comparing only if it reaches each kind of decision."""
    kinds = set()
    for row in TRACE:
        calls, outcome, _ = through_proxy(monkeypatch, *row)
        verdict = calls[0][-1]
        kinds.add((type(verdict).__name__, getattr(verdict, "shed", None) or getattr(verdict, "why", None)))
    assert {("Send", None), ("Queue", "saturated"), ("Queue", "restart"), ("Refuse", "saturated"),
            ("Refuse", None)} <= {
        (k, w or None) for k, w in kinds}
