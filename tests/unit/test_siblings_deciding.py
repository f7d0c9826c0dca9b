"""The sibling workers' decision lock (gateway.server.siblings): one worker decides at a time, and a
worker that dies inside a decision holds the others up for DECIDE_WAIT per decision, not for ever."""

from __future__ import annotations

import os
import time

from gateway.server.siblings import DECIDE_WAIT, SharedCounts


def test_a_decision_holds_the_lock_and_a_sibling_waits_for_it():
    table = SharedCounts.create(2)
    a, b = table.for_row(0), table.for_row(1)
    with a.deciding():
        t0 = time.monotonic()
        d = b.deciding()
        with d:
            assert not d.held  # a held it: b went on alone after the bounded wait
        assert time.monotonic() - t0 >= DECIDE_WAIT * 0.9
    d = b.deciding()
    with d:
        assert d.held  # free again


def test_a_worker_killed_inside_a_decision_costs_its_siblings_only_the_bounded_wait():
    table = SharedCounts.create(2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker that dies holding the lock
        table.for_row(1).deciding().__enter__()
        os.write(w, b"x")
        os._exit(0)
    os.read(r, 1)
    os.waitpid(pid, 0)
    sibling = table.for_row(0)
    t0 = time.monotonic()
    for _ in range(20):
        with sibling.deciding():
            pass
    assert time.monotonic() - t0 < 20 * DECIDE_WAIT + 0.5
