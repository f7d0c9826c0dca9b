"""The in-flight table the gunicorn workers of one gateway share (gateway.server.siblings), and routing on
it: a worker counts what its siblings hold as exactly as its own."""

import os

import pytest

from gateway.server import siblings
from gateway.config import GatewaySettings
from gateway.routing.choice import Choice, Rejection, RouteRequest
from gateway.server.siblings import PEAK_WINDOW, SharedCounts
from llmgw.state.records import LoadRecord
from tests.support.clock import FakeClock
from tests.support.routers import polled
from tests.unit.test_gateway_learning import Store, ep


def workers(n, rows=None):
    master = SharedCounts.create(rows or n)
    return master, [master.for_row(master.claim_row()) for _ in range(n)]


def test_a_worker_sees_its_siblings_counts_not_its_own():
    master, (a, b, c) = workers(3)
    for w in (a, b, c):
        w.adopt(100 + w.row)
    a.publish("ep-1", 0, 1, 10.0)
    a.publish("ep-1", 1, 2, 10.0)
    b.publish("ep-1", 0, 1, 10.0)
    b.publish("ep-2", 0, 1, 10.0)
    assert c.others(["ep-1", "ep-2", "ep-3"], 10.0) == {"ep-1": 3, "ep-2": 1}
    assert a.others(["ep-1", "ep-2"], 10.0) == {"ep-1": 1, "ep-2": 1}


def test_recent_reads_the_most_held_lately_for_a_scrape_taken_then():
    master, (a, b) = workers(2)
    a.adopt(1), b.adopt(2)
    for n in range(4):
        a.publish("e", n, n + 1, 10.0)
    for n in range(4, 1, -1):
        a.publish("e", n, n - 1, 10.5)
    assert b.others(["e"], 11.0) == {"e": 1}
    assert b.others(["e"], 11.0, recent=True) == {"e": 4}
    assert b.others(["e"], 10.0 + PEAK_WINDOW + 0.1, recent=True) == {"e": 1}


def test_a_freed_row_drops_its_counts_and_is_claimed_again():
    master, (a, b) = workers(2)
    a.adopt(1), b.adopt(2)
    a.publish("e", 0, 5, 1.0)
    assert master.claim_row() is None  # every row taken: the next worker counts alone
    master.free_row(a.row)
    assert b.others(["e"], 1.0) == {}
    again = master.claim_row()
    assert again == a.row
    fresh = master.for_row(again)
    fresh.adopt(3)
    assert b.others(["e"], 1.0) == {}  # the new worker starts from nothing


def test_entries_of_idle_endpoints_are_reused_without_losing_the_others():
    """Endpoints come and go with replicas: a row keeps counting the current ones however many have
    passed through it, and an endpoint still held keeps its entry."""
    master, (a, b) = workers(2)
    a.adopt(1), b.adopt(2)
    now = 100.0
    a.publish("kept", 0, 2, now)
    for i in range(4 * siblings.ENDPOINTS):  # many more than a row holds, each dropping to 0
        a.publish(f"old-{i}", 0, 1, now)
        a.publish(f"old-{i}", 1, 0, now)
    now += PEAK_WINDOW + 1
    for i in range(50):
        a.publish(f"new-{i}", 0, 1, now)
    seen = b.others([f"new-{i}" for i in range(50)] + ["kept"], now)
    assert seen == {**{f"new-{i}": 1 for i in range(50)}, "kept": 2}


def test_a_full_neighbourhood_counts_alone_rather_than_overwrite():
    master, (a, b) = workers(2)
    a.adopt(1), b.adopt(2)
    ids = [f"e{i}" for i in range(siblings.ENDPOINTS)]
    for e in ids:
        a.publish(e, 0, 1, 1.0)
    before = b.others(ids, 1.0)
    assert len(before) > siblings.ENDPOINTS * 0.8 and set(before.values()) == {1}
    for i in range(50):  # no room near their places: counted alone
        a.publish(f"more-{i}", 0, 1, 1.0)
    assert b.others(ids, 1.0) == before  # nobody held was written over


def test_the_table_is_shared_with_forked_children():
    """The master makes it before forking: a child's writes are what the parent reads."""
    master = SharedCounts.create(2)
    row = master.claim_row()
    parent = master.for_row(master.claim_row())
    pid = os.fork()
    if pid == 0:  # the child: publish, then leave without running the parent's cleanups
        child = master.for_row(row)
        child.adopt(os.getpid())
        child.publish("e", 0, 3, 1.0)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent.others(["e"], 1.0) == {"e": 3}


def gateway_pair(capacity=2):
    """Two workers of one gateway: routers over one store, one table."""
    master, (a, b) = workers(2)
    a.adopt(1), b.adopt(2)
    clock = FakeClock()
    store = Store([ep("x", capacity=capacity)])
    routers, pollers = [], []
    for view in (a, b):
        st, polls = polled(store, GatewaySettings(seed=1), clock, shared=view)
        polls.refresh_endpoints()
        routers.append(st)
        pollers.append(polls)
    return routers, pollers, store, clock


def test_capacity_counts_the_sibling_workers_requests_at_once():
    (one, two), _, _, _ = gateway_pair(capacity=2)
    req = RouteRequest("m")
    assert isinstance(one.route(req), Choice)
    assert isinstance(two.route(req), Choice)
    # Both slots are taken, one by each worker; neither knows it from a scrape.
    full = one.route(req)
    assert isinstance(full, Rejection) and full.kind == "saturated"
    assert isinstance(two.route(req), Rejection)


def test_a_siblings_release_frees_the_slot_for_this_worker():
    (one, two), _, _, _ = gateway_pair(capacity=1)
    held = one.route(RouteRequest("m"))
    assert isinstance(two.route(RouteRequest("m")), Rejection)
    one.release(held, None)
    assert isinstance(two.route(RouteRequest("m")), Choice)


def test_a_scrape_counts_the_siblings_requests_as_this_gateways():
    """A scrape showing three requests, all from the sibling, is not another gateway's traffic:
    without the table it would be counted twice (once as the sibling's, once as others')."""
    (one, two), (_, two_polls), store, clock = gateway_pair(capacity=8)
    for _ in range(3):
        assert isinstance(one.route(RouteRequest("m")), Choice)
    clock.advance(1.0)
    store.records["x"] = LoadRecord("x", clock.t, True, running=3, waiting=0)
    two_polls.refresh_loads()
    assert two.stats["x"].scrape_inflight == 3
    assert two.stats["x"].others_ratio == 0.0
    assert two.held(clock.monotonic()) == {"x": 3}


def test_without_a_table_each_worker_counts_alone():
    clock = FakeClock()
    store = Store([ep("x", capacity=1)])
    (one, one_polls), (two, two_polls) = (polled(store, GatewaySettings(seed=1), clock, shared=None) for _ in range(2))
    for polls in (one_polls, two_polls):
        polls.refresh_endpoints()
    # no process-wide table: a router gets one handed in, or none (a gunicorn worker hands its row to
    # the app factory only while it makes the app)
    assert not hasattr(siblings, "table") and siblings.handed() is None
    assert one.counts.shared is None and two.counts.shared is None
    assert isinstance(one.route(RouteRequest("m")), Choice)
    assert isinstance(two.route(RouteRequest("m")), Choice)


@pytest.mark.parametrize("rows", [0])
def test_setup_without_rows_makes_no_table(rows):
    table = siblings.setup(rows)
    assert table is None
    assert siblings.attach(table, 0) is None


def test_a_worker_accepts_as_many_connections_as_keep_it_level_with_its_least_loaded_sibling():
    from gateway.server.worker import ACCEPT_BATCH, ACCEPT_SLACK, accept_allowance

    assert accept_allowance(0, None) == ACCEPT_BATCH  # alone: a burst is taken at once
    assert accept_allowance(0, 0) == ACCEPT_SLACK  # two idle workers: neither takes a whole burst
    assert accept_allowance(10, 30) == 20 + ACCEPT_SLACK  # behind: it catches up in one turn
    assert accept_allowance(40, 10) == 1  # ahead: one per turn, as gunicorn's worker always did
    assert accept_allowance(0, 10_000) == ACCEPT_BATCH


def test_the_table_tells_each_worker_how_many_connections_the_others_hold():
    table = SharedCounts.create(4)
    rows = [table.claim_row() for _ in range(3)]
    views = [table.for_row(r) for r in rows]
    for pid, v in zip((101, 102, 103), views):
        v.adopt(pid)
    assert views[0].fewest_connections() == 0
    views[1].set_connections(7)
    views[2].set_connections(3)
    assert views[0].fewest_connections() == 3 and views[2].fewest_connections() == 0
    table.free_row(rows[0])  # a worker that exited counts no more
    assert views[1].fewest_connections() == 3
    alone = SharedCounts.create(1)
    assert alone.for_row(alone.claim_row()).fewest_connections() is None
