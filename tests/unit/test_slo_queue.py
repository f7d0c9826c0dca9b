"""The queue and eviction know a request's latency targets: within its class the waiting request with
the least slack goes first once its first byte is due soon (gateway.routing.ledger.Backlog.head), fair
share deciding while every waiter has more; and a request that will miss its first-byte target evicts
an answer with slack (gateway.routing.eviction.outranks), whose slack is gateway.routing.slo's."""

from __future__ import annotations

import math

import pytest

from gateway.routing import slo as targets
from gateway.routing.choice import Rejection, Slo
from gateway.routing.eviction import BATCH, Evict, Keep, Running, Settings, Waiting, evict, outranks
from gateway.routing.ledger import Backlog, Ledger
from gateway.routing.queue import WaitQueue
from llmgw.slo import Targets
from llmgw.state.keypolicy import Tenant

A, B, C = Tenant("a", "a"), Tenant("b", "b"), Tenant("c", "c")
URGENT = 1.0


def backlog(*waiters):
    """(tenant, name, due, rank) pushed in order; the ledger has b far ahead of a (a is owed service)."""
    led = Ledger()
    led.pending[("m", "b")] = 1000.0
    b = Backlog()
    for tenant, name, due, rank in waiters:
        b.push(tenant, name, led, "m", rank=rank, due=due)
    return b, led


@pytest.mark.parametrize("waiters,now,head", [
    # no targets: fair share (a, the key least served)
    ([(A, "a1", math.inf, 1), (B, "b1", math.inf, 1)], 0.0, "a1"),
    # b's request is due in 0.3 s: it goes first, whatever fair share says
    ([(A, "a1", math.inf, 1), (B, "b1", 0.3, 1)], 0.0, "b1"),
    # due in 5 s: it has slack, fair share decides until it is within the urgent window
    ([(A, "a1", math.inf, 1), (B, "b1", 5.0, 1)], 0.0, "a1"),
    ([(A, "a1", math.inf, 1), (B, "b1", 5.0, 1)], 4.5, "b1"),
    # the least due first, within one tenant's FIFO too
    ([(A, "a1", 0.5, 1), (B, "b1", 0.9, 1), (B, "b2", 0.2, 1)], 0.0, "b2"),
    # a higher class goes first: a critical waiter without target before a standard one due now
    ([(B, "b1", 0.1, 1), (C, "c1", math.inf, 2)], 0.0, "c1"),
    # a lower class due now does not pass a standard waiter (fair order within the top class)
    ([(A, "a1", math.inf, 1), (B, "b1", 0.1, 0)], 0.0, "a1"),
])
def test_the_least_slack_goes_first_once_it_runs_short(waiters, now, head):
    b, led = backlog(*waiters)
    assert b.head(led, "m", now, URGENT) == head


def test_a_waiter_that_left_is_no_longer_first_and_the_heap_empties_with_the_timed():
    b, led = backlog((A, "a1", math.inf, 1), (B, "b1", 0.2, 1), (B, "b2", 0.4, 1))
    b.remove(B, "b1")
    assert b.head(led, "m", 0.0, URGENT) == "b2"
    b.remove(B, "b2")
    assert b.head(led, "m", 0.0, URGENT) == "a1" and not b.dues and not b.timed


def test_a_request_due_soon_is_placed_by_its_due_time():
    b, _ = backlog(*[(A, f"a{i}", math.inf, 1) for i in range(30)], (B, "b1", 0.2, 1), (B, "b2", 0.8, 1))
    assert b.position(C, False, 0.5, 0.0, URGENT) == 2  # after b1 only, not behind thirty of a's
    assert b.position(C, False, 0.1, 0.0, URGENT) == 1
    assert b.position(C, False, 9.0, 0.0, URGENT) == b.position(C, False)  # not due soon: its fair place


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_wait_queue_orders_its_waiters_by_their_due_times():
    clock = Clock()
    q = WaitQueue(100, monotonic=clock, urgent=URGENT)
    from gateway.routing.queue import Ticket
    lax, tight = Ticket(0.0, 5.0), Ticket(0.0, 0.3)
    with q.lock:
        q.waiters.push(A, lax, q.ledger, "m", due=lax.due)
        q.waiters.push(B, tight, q.ledger, "m", due=tight.due)
    assert q.head() is tight
    assert q.position(C, 0.2) == 1 and q.position(C, 0.4) == 2


R = Running(1, "e1", "standard", "heavy", 1000.0, 10, 5.0)
S = Settings(slack=5.0)


@pytest.mark.parametrize("w,r,why", [
    # would miss its TTFT: evicts an answer without targets, or with time to spare (even its own key's)
    (Waiting("standard", "light", 1000.0, 100.0, slack=-0.05), R, "will miss its first-byte target by 0.050s"),
    (Waiting("standard", "heavy", 1000.0, 100.0, slack=-0.05), R, "it has no targets"),
    (Waiting("standard", "light", 1000.0, 100.0, slack=-0.05), Running(1, "e1", "standard", "heavy", 1000.0, 10, 5.0,
                                                                       slack=30.0), "30.0s to spare"),
    # not an answer short of slack itself
    (Waiting("standard", "light", 1000.0, 100.0, slack=-0.05), Running(1, "e1", "standard", "heavy", 1000.0, 10, 5.0,
                                                                       slack=2.0), None),
    # not while it can still make it, nor without a target
    (Waiting("standard", "light", 1000.0, 100.0, slack=0.1), R, None),
    (Waiting("standard", "light", 1000.0, 100.0), R, None),
    # never a higher class's answer
    (Waiting("sheddable", "light", 0.0, 100.0, slack=-1.0), R, None),
    # a class above outranks as before
    (Waiting("standard", "light", 1000.0, 100.0, slack=5.0), Running(1, "e1", BATCH, "b", 0.0, 10, 5.0),
     "an interactive request over a batch line"),
])
def test_a_request_that_will_miss_its_ttft_outranks_an_answer_with_slack(w, r, why):
    got = outranks(w, r, S)
    assert got is None if why is None else why in got


def test_the_victim_is_still_the_cheapest_of_those_it_outranks():
    w = Waiting("standard", "light", 1000.0, 100.0, slack=-0.1)
    short = Running(2, "e1", "standard", "x", 1000.0, 3, 5.0, slack=None)
    tight = Running(3, "e1", "standard", "x", 1000.0, 1, 5.0, slack=0.5)  # fewer tokens, but no slack
    got = evict(w, [R, short, tight], S)
    assert isinstance(got, Evict) and got.victim.ident == 2
    assert isinstance(evict(Waiting("standard", "light", 1000.0, 100.0, slack=1.0), [R], S), Keep)


@pytest.mark.parametrize("t,elapsed,running_for,began,spare", [
    (Targets(tpot=0.05), 1.0, 0.5, True, 0.0),  # a pause breaks its pace: none to spare
    (Targets(deadline=60.0), 10.0, 4.0, True, 46.0),  # as long again as it ran, before its deadline
    (Targets(ttft=0.5), 0.2, 0.1, False, 0.3),  # its first byte still to come
    (Targets(ttft=0.5), 0.9, 0.7, True, None),  # its first byte went out: nothing left to meet
])
def test_what_a_running_answer_has_to_spare(t, elapsed, running_for, began, spare):
    assert targets.running_slack(t, elapsed, running_for, began) == (pytest.approx(spare) if spare is not None else None)


def test_what_a_waiting_request_has_to_spare_past_the_next_free_slot():
    sat = Rejection("saturated", "m", predicted=0.05)
    assert targets.slack(Slo(0.3, None, None), 0.1, sat, 20.0) == pytest.approx(0.3 - 0.1 - 0.05 - 0.05)
    assert targets.slack(Slo(0.3, None, None), 0.25, sat, 20.0) < 0
    assert targets.slack(Slo(0.3, None, None), 0.0, sat, None) == pytest.approx(0.25)  # no rate: no wait counted
    assert targets.slack(Slo(None, 0.05, None), 0.0, sat, 20.0) is None
