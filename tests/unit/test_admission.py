"""Admission decisions when a model is saturated, and the bounded FIFO wait queue on a fake clock
(with threads: tests/integration/test_gateway_queue.py)."""

import pytest

from gateway.routing.admission import Send, Shed, Wait, admit, drain_time
from gateway.routing.choice import Choice, Rejection
from gateway.routing.queue import WaitQueue
from llmgw.state.records import EndpointInfo
from tests.support.clock import FakeClock

EP = EndpointInfo(id="a", url="http://a", models=("m",), engine="sim")
OK = Choice(EP, 0.1, 0)
SAT = Rejection("saturated", "m")


@pytest.mark.parametrize(
    "result, prio, qlen, expect",
    [
        (OK, "standard", 0, Send(OK)),
        (OK, "sheddable", 0, Send(OK)),
        (SAT, "sheddable", 0, Shed),
        (SAT, "standard", 0, Wait()),
        (SAT, "standard", 64, Shed),  # queue full
        (OK, "standard", 3, Send(OK)),  # the router already weighed the queue
        (OK, "sheddable", 3, Shed),  # standard requests wait: sheddable ones go first
        (OK, "critical", 3, Send(OK)),  # critical never waits
        (Rejection("unknown_model", "x"), "standard", 0, Rejection("unknown_model", "x")),
    ],
)
def test_admit_table(result, prio, qlen, expect):
    got = admit(result, prio, qlen, queue_max=64, queue_timeout=5)
    if expect is Shed:
        assert isinstance(got, Shed) and got.retry_after >= 1
    else:
        assert got == expect


def test_no_queue_configured_sheds_standard():
    assert isinstance(admit(SAT, "standard", 0, queue_max=64, queue_timeout=0), Shed)


def test_standard_is_refused_at_once_only_when_the_queue_cannot_drain_in_time():
    # 20 waiting ahead, the fleet completes 2 requests/s: this one would get an endpoint in 10.5 s.
    drain = drain_time(21, 2.0)
    assert drain == pytest.approx(10.5)
    assert admit(SAT, "standard", 20, queue_max=64, queue_timeout=30, drain=drain) == Wait()
    got = admit(SAT, "standard", 20, queue_max=64, queue_timeout=8, drain=drain)
    assert isinstance(got, Shed) and got.retry_after == 3 and "10s" in got.reason and "8s" in got.reason
    # an unknown rate (nothing learned yet) never refuses: the wait bound still holds
    assert drain_time(21, None) is None
    assert admit(SAT, "standard", 20, queue_max=64, queue_timeout=8, drain=None) == Wait()
    # critical is never shed for saturation, sheddable always is
    assert isinstance(admit(OK, "critical", 20, queue_max=64, queue_timeout=8, drain=drain), Send)
    assert isinstance(admit(SAT, "sheddable", 0, queue_max=64, queue_timeout=8, drain=0.1), Shed)


def test_queue_times_out_and_is_bounded():
    clock = FakeClock(0.0)
    q = WaitQueue(max_len=1, recheck=0.001, monotonic=clock.monotonic)
    calls = []

    def attempt():
        calls.append(1)
        clock.advance(1)  # each try takes a "second" of fake time
        return SAT

    assert q.wait(attempt, timeout=3) is None
    assert len(calls) >= 3 and len(q) == 0


def test_queue_full_rejects_at_once():
    q = WaitQueue(max_len=0)
    assert q.wait(lambda: OK, timeout=5) is None
