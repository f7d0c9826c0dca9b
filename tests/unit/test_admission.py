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


# --- continuations are admitted work, and a request that displaces a running answer waits for it ----------------
def test_a_continuation_is_never_refused_for_saturation_and_waits_at_the_head():
    from gateway.routing.admission import RESUMING, Queue, Request, Settings, after_wait, decide

    cfg = Settings(queue_max=4, queue_timeout=5, resume_wait=600)
    for prio in ("sheddable", "batch", "standard", "critical"):
        step = decide(SAT, 64, Request(prio, "m", first=False, rate=0.01, continuation=True), cfg)
        assert step == Queue(600, RESUMING, head=True)  # a full queue and a slow fleet: still queued
    assert decide(OK, 0, Request("sheddable", "m", continuation=True), cfg) == Send(OK)
    # a restart hold never sheds it for a full queue either
    held = decide(Rejection("no_ready", "m"), 64, Request("standard", "m", restart=30, continuation=True), cfg)
    assert isinstance(held, Queue) and held.timeout == 30
    gave_up = after_wait(None, Queue(600, RESUMING, head=True))
    assert gave_up.during == RESUMING and gave_up.error.seconds == 600


def test_a_request_that_displaces_an_answer_waits_for_its_slot_instead_of_being_shed():
    from gateway.routing.admission import SATURATED, Queue, Refuse, Request, Settings, decide

    cfg = Settings(queue_max=4, queue_timeout=5)
    assert isinstance(decide(SAT, 0, Request("sheddable", "m"), cfg), Refuse)
    assert decide(SAT, 0, Request("sheddable", "m", displaces=True), cfg) == Queue(5, SATURATED)
    assert isinstance(decide(SAT, 9, Request("standard", "m", rate=0.01), cfg), Refuse)  # would drain too slowly
    assert decide(SAT, 9, Request("standard", "m", rate=0.01, displaces=True), cfg) == Queue(5, SATURATED)
    assert isinstance(decide(SAT, 0, Request("batch", "m"), cfg), Refuse)  # a batch line is shed like sheddable


def test_a_continuation_joins_at_the_head_of_its_tenants_fifo_and_past_the_bound():
    from gateway.routing.ledger import Backlog, Ledger
    from llmgw.state.keypolicy import Tenant

    heavy = Tenant("k-h", "heavy", 1.0, "")
    b, led = Backlog(), Ledger()
    for item in ("h1", "h2"):
        b.push(heavy, item, led, "m")
    b.push(heavy, "cont", led, "m", front=True)
    assert b.head(led, "m") == "cont" and len(b) == 3
    b.push(heavy, "cont2", led, "m", front=True)
    assert b.head(led, "m") == "cont2"


def test_a_higher_class_waits_ahead_of_a_lower_ones_continuation_whatever_the_counters():
    from gateway.routing.ledger import Backlog, Ledger
    from llmgw.state.keypolicy import PRIORITY_RANK, Tenant

    batch, team = Tenant("k-b", "batch", 1.0, ""), Tenant("k-t", "team", 1.0, "")
    b, led = Backlog(), Ledger()
    led.pending[("m", "k-t")] = 1e6  # the interactive key has had far more service
    b.push(team, "interactive", led, "m", rank=PRIORITY_RANK["standard"])
    b.push(batch, "batch line, evicted", led, "m", front=True, rank=PRIORITY_RANK["batch"])
    assert b.head(led, "m") == "interactive"
    b.remove(team, "interactive")
    assert b.head(led, "m") == "batch line, evicted"


def test_where_others_wait_a_continuation_or_a_newcomer_lines_up_instead_of_taking_the_free_slot():
    from gateway.routing.admission import RESUMING, SATURATED, Queue, Refuse, Request, Settings, decide

    cfg = Settings(queue_max=4, queue_timeout=5, resume_wait=600)
    # a continuation takes a free slot only when nobody waits, here or in a sibling worker
    assert decide(OK, 0, Request("standard", "m", first=False, continuation=True), cfg) == Send(OK)
    assert decide(OK, 2, Request("standard", "m", first=False, continuation=True), cfg) == \
        Queue(600, RESUMING, head=True, give_back=True)
    assert decide(OK, 0, Request("standard", "m", first=False, continuation=True, elsewhere=3), cfg) == \
        Queue(600, RESUMING, head=True, give_back=True)
    # a new request lines up with the sibling workers' waiting requests (the queue's order decides)
    assert decide(OK, 0, Request("standard", "m", elsewhere=3), cfg) == Queue(5, SATURATED, give_back=True)
    assert decide(OK, 0, Request("standard", "m", elsewhere=0), cfg) == Send(OK)
    assert decide(OK, 0, Request("critical", "m", elsewhere=3), cfg) == Send(OK)  # critical never waits
    shed = decide(OK, 0, Request("sheddable", "m", elsewhere=3), cfg)
    assert isinstance(shed, Refuse) and shed.give_back
    assert decide(OK, 0, Request("standard", "m", first=False, elsewhere=3), cfg) == Send(OK)  # a retry
