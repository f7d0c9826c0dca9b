"""What the router predicts for a request on the endpoint it chooses (gateway.routing.choice.predict):
its first token, its time per token and its whole answer, from the terms `score` already has; and the
per-token speed it is built on (gateway.routing.learn.speed_of)."""

from __future__ import annotations

import random

import pytest

from gateway.config import RoutingConfig
from gateway.routing.choice import Choice, RouteContext, RouteRequest, choose
from gateway.routing.learn import Learned, speed_of
from gateway.routing.load import EndpointStats
from gateway.routing.speed import Fit, Speed, shrink
from llmgw.state.records import EndpointInfo

NOW = 100.0
A = EndpointInfo(id="a", url="http://a", models=("m",), engine="sim", model="m", capacity=4)
SP = Speed(decode1=1.0, slowdown=0.1, ttfb=0.05, per_token=0.02)


def routed(held, stats=None, backlog=None, req=RouteRequest("m", "critical")) -> Choice:
    ctx = RouteContext([A], {}, {"a": held}, NOW, random.Random(1), RoutingConfig(),
                       stats if stats is not None else {"a": EndpointStats(speed=SP, last_sample=NOW)},
                       backlog=backlog)
    got = choose(ctx, req)
    assert isinstance(got, Choice)
    return got


@pytest.mark.parametrize("held,backlog,ttft,tpot,total", [
    (0, None, 0.05, 0.02, 1.05),  # alone: its first byte, then a request's decode alone
    (2, None, 0.05, 0.024, 1.25),  # a batch of three: each step 20 % slower
    (2, {"a": 0.2}, 0.25, 0.024, 1.45),  # behind 0.2 s of prefill queued there
    # full (4 slots): it waits for 2 of the 5 ahead to end, 1.3 s each over 4 slots, then runs in a full batch
    (5, None, 0.05 + 2 * 1.3 / 4, 0.026, 0.05 + 2 * 1.3 / 4 + 1.3),
    (5, {"a": 0.2}, 0.05 + 2 * 1.3 / 4, 0.026, 0.05 + 2 * 1.3 / 4 + 1.3),  # the backlog clears while it waits
])
def test_the_prediction_is_the_terms_of_the_score(held, backlog, ttft, tpot, total):
    c = routed(held, backlog=backlog)
    assert c.predicted_ttft == pytest.approx(ttft)
    assert c.predicted_tpot == pytest.approx(tpot)
    assert c.predicted_total == pytest.approx(total)


def test_nothing_is_predicted_before_the_speed_is_learned():
    c = routed(0, stats={})
    assert (c.predicted_ttft, c.predicted_tpot, c.predicted_total) == (None, None, None)
    c = routed(0, stats={"a": EndpointStats(speed=Speed(1.0, 0.1, 0.05), last_sample=NOW)})
    assert c.predicted_ttft == pytest.approx(0.05) and c.predicted_tpot is None  # tokens per answer unknown


def test_the_speed_per_token_follows_the_tokens_per_answer():
    f = Fit()
    for conc, secs in ((1, 1.0), (2, 1.1), (3, 1.2), (1, 1.0)):
        f = f.add(conc, secs, 0.0, 10.0)
    sp, _ = speed_of(Learned(per_request=f, ttfb=0.05), 51.0)
    assert sp.per_token == pytest.approx(sp.decode1 / 50)
    assert sp.tpot(0, 8) == pytest.approx(sp.per_token)
    assert sp.tpot(3, 8) == pytest.approx(sp.per_token * (1 + 3 * sp.slowdown))
    assert sp.tpot(20, 8) == pytest.approx(sp.per_token * (1 + 7 * sp.slowdown))  # a full batch
    assert speed_of(Learned(per_request=f), None)[0].per_token == 0.0
    # pulled toward a common speed, each keeps its tokens per answer
    for s in shrink([(sp, 0.5), (Speed(2.0, 0.1, 0.05, 0.04), 0.5)]):
        assert s.per_token == pytest.approx(s.decode1 / 50)
