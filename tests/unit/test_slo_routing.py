"""Routing and admission that meet latency targets (gateway.routing.choice `_with_targets`,
gateway.routing.slo): among the endpoints predicted to meet a request's targets it is routed as
usual; when none will, a strict request is refused with the predicted time and any other goes where
its miss is smallest; a lax request leaves the last free slots to tight ones; a strict request that
would wait past its target is refused at once, or waits only as long as its target allows."""

from __future__ import annotations

import math
import random

import pytest

from gateway.config import RoutingConfig
from gateway.routing import slo as targets
from gateway.routing.admission import SATURATED, Queue, Refuse, Send, Shed, TimedOut
from gateway.routing.choice import MISSES, Choice, Rejection, RouteContext, RouteRequest, Slo, choose, lateness
from gateway.routing.load import EndpointStats
from gateway.routing.speed import Speed
from llmgw.slo import Targets
from llmgw.state.records import EndpointInfo

NOW = 100.0
FAST = Speed(decode1=1.0, slowdown=0.1, ttfb=0.05, per_token=0.02)
SLOW = Speed(decode1=4.0, slowdown=0.1, ttfb=0.4, per_token=0.08)
EPS = [EndpointInfo(id=i, url=f"http://{i}", models=("m",), engine="sim", model="m", capacity=4) for i in "fs"]
STATS = {"f": EndpointStats(speed=FAST, last_sample=NOW), "s": EndpointStats(speed=SLOW, last_sample=NOW)}


def route(slo, held=None, priority="standard", waited=0.0, cfg=RoutingConfig(), stats=STATS):
    ctx = RouteContext(EPS, {}, held or {}, NOW, random.Random(1), cfg, stats)
    return choose(ctx, RouteRequest("m", priority, waited=waited, slo=slo))


TIGHT = Slo(0.3, None, None)
STRICT = Slo(0.3, None, None, strict=True)


def test_a_request_goes_to_an_endpoint_predicted_to_meet_its_targets():
    got = route(TIGHT, {"f": 2})
    assert isinstance(got, Choice) and got.endpoint.id == "f" and "meets its targets" in got.reason
    # per token: the slow one's 80 ms misses a 50 ms target, whatever its load
    assert route(Slo(None, 0.05, None), {"f": 3}).endpoint.id == "f"
    # a whole answer (not streamed) within 2 s: only the fast one (1.05 s against 4.4 s)
    assert route(Slo(None, None, 2.0, stream=False), {"f": 3}).endpoint.id == "f"
    assert isinstance(route(None, {"f": 3}), Choice)  # without targets: by cost alone, as before


def test_when_none_will_meet_them_a_strict_request_is_refused_and_another_goes_where_it_misses_least():
    full = {"f": 4}  # the fast one is full: only the slow one (first byte in 400 ms) is open
    lax = route(TIGHT, full)
    assert isinstance(lax, Choice) and lax.endpoint.id == "s" and "least miss" in lax.reason
    strict = route(STRICT, full)
    assert isinstance(strict, Rejection) and strict.kind == MISSES
    assert strict.predicted == pytest.approx(0.4) and "s, predicts its first byte in 400 ms (target 300 ms)" in strict.detail
    # time already spent waiting counts against it: 280 ms of 300 waited, even the fast one misses
    late = route(STRICT, {}, waited=0.28)
    assert isinstance(late, Rejection) and late.kind == MISSES
    # critical is refused too when strict: it asked for a refusal rather than a late answer
    assert route(STRICT, full, priority="critical").kind == MISSES


def test_a_saturated_model_says_what_first_byte_a_request_would_get_once_a_slot_frees():
    got = route(TIGHT, {"f": 4, "s": 4})
    assert got.kind == SATURATED and got.predicted == pytest.approx(0.05)
    whole = route(Slo(None, None, 9.0, stream=False), {"f": 4, "s": 4})
    assert whole.predicted == pytest.approx(0.05 + 1.0 * 1.3)  # its whole answer, in a full batch


def test_a_lax_request_leaves_the_last_free_slots_to_tight_ones():
    lax = Slo(5.0, None, 60.0)
    held = {"f": 3, "s": 4}  # one slot free in the whole model
    got = route(lax, held)
    assert isinstance(got, Rejection) and got.kind == SATURATED and "leaves the last free slots" in got.detail
    assert got.retry_in == pytest.approx(5.0 - 0.05 - 2.0)  # until it is no longer lax
    assert route(TIGHT, held).endpoint.id == "f"  # the tight one takes it
    assert isinstance(route(lax, {"f": 2, "s": 4}), Choice)  # two free: it takes one
    assert isinstance(route(lax, held, cfg=RoutingConfig(slo_reserve=0)), Choice)
    assert isinstance(route(lax, held, waited=3.0), Choice)  # 1.95 s to spare: no longer lax
    assert isinstance(route(lax, held, priority="sheddable"), Choice)  # never queued to wait: not deferred


def test_before_any_speed_is_learned_every_endpoint_is_taken_to_meet_them():
    got = route(STRICT, {"f": 1}, stats={})
    assert isinstance(got, Choice) and got.predicted_ttft is None


@pytest.mark.parametrize("pred,slo,waited,late", [
    ((0.1, 0.02, 1.0), Slo(0.3, None, None), 0.0, 0.0),
    ((0.45, 0.02, 1.0), Slo(0.3, None, None), 0.0, 0.5),
    ((0.1, 0.02, 1.0), Slo(0.3, None, None), 0.25, (0.1 - 0.05) / 0.3),
    ((0.1, 0.06, 1.0), Slo(None, 0.05, None), 0.0, 0.2),
    ((0.1, None, 1.0), Slo(None, 0.05, None), 0.0, 0.0),  # per token not predicted: not counted
    ((0.1, 0.02, 3.0), Slo(None, None, 2.0), 0.0, 0.5),
    ((0.1, 0.02, 3.0), Slo(1.0, None, None, stream=False), 0.0, 2.0),  # not streamed: the whole answer is its first byte
    (None, Slo(0.001, None, None), 0.0, 0.0),
])
def test_lateness(pred, slo, waited, late):
    assert lateness(pred, slo, waited) == pytest.approx(late)


SAT = Rejection("saturated", "m", predicted=0.05)
QUEUED = Queue(30.0, SATURATED)


@pytest.mark.parametrize("step,result,slo,position,rate,expected", [
    # routing found no open endpoint that meets it: refused, told when to retry
    (Refuse(Rejection(MISSES, "m", "nope", predicted=1.4)), Rejection(MISSES, "m", "nope", predicted=1.4), STRICT, 1,
     None, Refuse(Shed("nope (X-LLMGW-SLO: strict)", 2), targets.SLO_MISS)),
    # saturated: 5th in line at 10 a second is 0.5 s, then 50 ms: over 300 ms
    (QUEUED, SAT, STRICT, 5, 10.0, "refused"),
    # next in line: 0.1 s + 50 ms: it waits, but only until 250 ms (then its first byte would be late)
    (QUEUED, SAT, STRICT, 1, 10.0, Queue(0.25, SATURATED)),
    (QUEUED, SAT, STRICT, 50, None, Queue(0.25, SATURATED)),  # the rate not known yet: only the bound
    (QUEUED, SAT, TIGHT, 5, 10.0, QUEUED),  # not strict: waits as before
    (Send(Choice(EPS[0], 0.1, 0)), Choice(EPS[0], 0.1, 0), STRICT, 1, None, Send(Choice(EPS[0], 0.1, 0))),
    (Queue(30.0, "cold_start"), Rejection("unknown_model", "m"), STRICT, 1, 10.0, Queue(30.0, "cold_start")),
])
def test_admission_of_a_request_with_targets(step, result, slo, position, rate, expected):
    got = targets.admit(step, result, slo, position, rate)
    if expected == "refused":
        assert isinstance(got, Refuse) and got.shed == targets.SLO_MISS and got.error.retry_after == 1
        assert "its first byte in about 550ms (a wait of 500ms for its turn in the queue, then 50ms)" in got.error.reason
    else:
        assert got == expected


def test_a_strict_request_whose_wait_ran_out_before_the_bound_is_refused_as_late():
    step = targets.after_wait(Refuse(TimedOut(0.25), "queue_timeout"), STRICT, Queue(0.25, SATURATED), 30.0)
    assert step.shed == targets.SLO_MISS and "can no longer come within its target" in step.error.reason
    whole = Refuse(TimedOut(30.0), "queue_timeout")
    assert targets.after_wait(whole, STRICT, Queue(30.0, SATURATED), 30.0) is whole  # the queue's own bound
    assert targets.after_wait(Refuse(TimedOut(0.25), "queue_timeout"), TIGHT, Queue(0.25, SATURATED), 30.0).shed == \
        "queue_timeout"
    missed = targets.after_wait(Refuse(Rejection(MISSES, "m", "far")), STRICT, QUEUED, 30.0)
    assert missed == Refuse(Shed("far (X-LLMGW-SLO: strict)", 1), targets.SLO_MISS)


def test_routing_reads_the_targets_less_what_the_request_already_spent():
    assert targets.slo_of(Targets(), 1.0, True) is None
    assert targets.slo_of(Targets(0.3, 0.05, 60.0, True), 0.1, False) == Slo(pytest.approx(0.2), 0.05, 59.9, True, False)
    assert targets.budget(Slo(0.3, None, 2.0, stream=False)) == 0.3 and targets.budget(Slo(None, None, 2.0)) == 2.0
    assert targets.due(10.0, Targets(ttft=0.3)) == 10.3 and targets.due(10.0, Targets(deadline=60.0)) == 70.0
    assert math.isinf(targets.due(10.0, Targets(tpot=0.05)))
