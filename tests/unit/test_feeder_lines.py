"""The gateway's count of the batch lines it holds, by feeder (gateway/observe/feeders.py, the lease
of gateway/http/attempt.py that feeds it, the report's `feeders`): a line is counted only while its
slot is, and the report reads both at one instant."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from gateway.http.attempt import FedLease
from gateway.observe.feeders import FEEDER_MAX, FeederLines, feeder_of
from gateway.observe.report import Identity, gateway_report
from llmgw.state.demand_records import GatewayReport


class Slots:
    """The router as a lease sees it: `release` gives a slot back; `held` is the in-flight count."""

    def __init__(self, held: int):
        self.held = held
        self.during = None  # set by a test: called while the slot is given back

    def release(self, choice, *args) -> None:
        if self.during is not None:
            self.during()
        self.held -= 1


def test_a_line_is_counted_while_its_slot_is_held_and_released_once():
    lines, slots = FeederLines(), Slots(held=2)
    a, b = FedLease(slots, SimpleNamespace(), lines, "f-1"), FedLease(slots, SimpleNamespace(), lines, "f-1")
    assert lines.read(lambda: slots.held) == ({"f-1": 2}, 2)
    a.release(1.0, 10, 0.1)
    a.release()  # the request path's `finally` after the answer's completion: nothing more
    assert lines.read(lambda: slots.held) == ({"f-1": 1}, 1)
    b.release()
    assert lines.read(lambda: slots.held) == ({}, 0)


def test_a_report_never_counts_a_line_its_endpoint_count_no_longer_holds():
    """A report taken while a line is given back sees it in both counts or in neither."""
    lines, slots = FeederLines(), Slots(held=1)
    lease = FedLease(slots, SimpleNamespace(), lines, "f-1")
    seen = []
    reading = threading.Event()

    def report():
        reading.set()
        seen.append(lines.read(lambda: slots.held))

    t = threading.Thread(target=report)
    slots.during = lambda: (t.start(), reading.wait(1))  # the report begins mid-release
    lease.release()
    t.join(1)
    assert seen == [({}, 0)]


def test_the_report_says_each_feeders_lines():
    who = Identity("h:1", "h", 1, 0.0)
    r = gateway_report(who, 10.0, 1, True, {"e": 3}, {}, {}, {"m": 3}, {}, {}, None, {"f-1": 2, "f-2": 0})
    assert r.feeders == {"f-1": 2}
    assert GatewayReport.from_dict(r.to_dict()) == r
    bare = gateway_report(who, 10.0, 1, True, {"e": 3}, {}, {}, {"m": 3}, {}, {})
    assert "feeders" not in bare.to_dict() and GatewayReport.from_dict(bare.to_dict()).feeders == {}
    assert feeder_of(None) == "" and feeder_of(" f-1 ") == "f-1" and len(feeder_of("x" * 500)) == FEEDER_MAX
