"""The wait queue wakes its head on events, not on a poll; a waiter whose client left takes itself
out; and whether a client left is read from its socket without consuming a byte
(gateway.routing.queue, gateway.request.client). Threads and real sockets, no sleeps."""

from __future__ import annotations

import socket
import threading
import time

from gateway.request.client import ClientConn
from gateway.routing.choice import Choice, Rejection
from gateway.routing.ledger import NO_TENANT
from gateway.routing.queue import GONE, Ticket, WaitQueue, WaitQueues
from llmgw.state.records import EndpointInfo
from harness.procs import wait_until

EP = EndpointInfo(id="a", url="http://a", models=("m",), engine="sim")
OK = Choice(EP, 0.1, 0)
SAT = Rejection("saturated", "m")


class Attempts:
    def __init__(self, *results):
        self.results, self.calls = list(results), 0

    def __call__(self):
        self.calls += 1
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]


def waiting(q: WaitQueue, attempt, timeout: float = 10.0, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.__setitem__("res", q.wait(attempt, timeout, **kw)))
    t.start()
    return t, out


def test_nothing_polls_a_saturated_queue():
    q = WaitQueue(max_len=4, recheck=60)
    attempt = Attempts(SAT)
    t0 = time.monotonic()
    assert q.wait(attempt, 0.3) is None  # timed out
    # Tried on entry and once more at its deadline, nothing between (a 50 ms poll tried 7 times).
    assert attempt.calls == 2
    assert time.monotonic() - t0 < 5


def test_only_the_head_is_woken_and_the_next_goes_when_it_leaves():
    q = WaitQueue(max_len=4, recheck=60)
    head, second = Attempts(SAT, OK), Attempts(OK)
    t1, out1 = waiting(q, head)
    wait_until(lambda: head.calls == 1, 5, interval=0.001, what="the head's first try")
    t2, out2 = waiting(q, second)
    wait_until(lambda: len(q) == 2, 5, interval=0.001, what="the second in line")
    assert second.calls == 0  # not the head: it never routes
    q.notify()  # a slot freed: the head takes it, and on leaving hands the turn to the next
    t1.join(5)
    t2.join(5)
    assert out1["res"] is OK and out2["res"] is OK
    assert (head.calls, second.calls) == (2, 1) and len(q) == 0


def test_a_deferral_that_time_ends_is_looked_at_again_then():
    q = WaitQueue(max_len=4, recheck=60)
    attempt = Attempts(Rejection("saturated", "m", "deferred", retry_in=0.05), OK)
    t0 = time.monotonic()
    assert q.wait(attempt, 10) is OK
    assert attempt.calls == 2 and time.monotonic() - t0 < 5


def test_a_waiter_whose_client_left_leaves_the_queue():
    q = WaitQueue(max_len=4, recheck=60)
    left = threading.Event()
    wakes: list = []
    attempt = Attempts(SAT)
    t, out = waiting(q, attempt, gone=left.is_set, watch=lambda wake: wakes.append(wake) or (lambda: wakes.clear()))
    wait_until(lambda: wakes and attempt.calls == 1, 5, interval=0.001, what="the waiter to watch its client")
    left.set()
    wakes[0]()  # what gevent's loop calls when the client's socket turns readable
    t.join(5)
    assert out["res"] is GONE and len(q) == 0
    assert attempt.calls == 1 and wakes == []  # never routed again, and the watch was cancelled


def test_a_release_wakes_only_the_queues_of_its_model():
    qs = WaitQueues(4, model_of={"m": "m", "m-alias": "m", "x1": "m", "other": "other"}.get)
    tickets = {}
    for name in ("m", "m-alias", "x1", "other"):
        tickets[name] = Ticket()
        q = qs.get(name)
        q.waiters.push(NO_TENANT, tickets[name], q.ledger, name)
    qs.wake("m")
    assert {n for n, t in tickets.items() if t.event.is_set()} == {"m", "m-alias", "x1"}
    qs.wake(None)  # new loads or a new list: every queue
    assert tickets["other"].event.is_set()


def test_the_client_socket_tells_a_departure_from_a_pipelined_request():
    a, b = socket.socketpair()
    try:
        client = ClientConn(a)
        assert client.gone() is False  # quiet: still waiting for its answer
        b.sendall(b"GET / HTTP/1.1\r\n")
        assert client.gone() is False  # a request behind this one: still there
        assert a.recv(64) == b"GET / HTTP/1.1\r\n"  # and nothing was consumed
        b.close()
        assert client.gone() is True
    finally:
        a.close()
    assert ClientConn(None).gone() is False and ClientConn(None).when_readable(lambda: None) is None


def test_a_sibling_worker_freeing_a_slot_is_seen_by_the_others():
    from gateway.server.siblings import SharedCounts

    table = SharedCounts.create(3)
    rows = [table.for_row(r) for r in (table.claim_row(), table.claim_row())]
    for i, w in enumerate(rows):
        w.adopt(100 + i)
    me, sibling = rows
    assert me.releases() == 0
    sibling.publish("e1", 0, 1, 1.0)  # a request taken: nothing to wake for
    assert me.releases() == 0
    sibling.publish("e1", 1, 0, 2.0)  # one released
    assert me.releases() == 1 and sibling.releases() == 0  # a worker's own releases wake it directly
    table.free_row(1)  # the sibling exited: its row no longer counts
    assert me.releases() == 0
