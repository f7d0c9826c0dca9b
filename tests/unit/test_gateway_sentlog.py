"""What each gunicorn worker sent where, shared (gateway.server.sentlog): a worker reads its siblings'
entries once, never its own, across the ring's end, and loses (never misreads) what it fell too far
behind on; two routers on one table agree on where a conversation's history is."""

from gateway.config import GatewaySettings
from gateway.routing.choice import Choice, RouteRequest
from gateway.routing.prefixkeys import prefix_of
from gateway.server.sentlog import SentLog
from gateway.server.siblings import SharedCounts, key_of
from llmgw.surface import CHAT
from tests.support.clock import FakeClock
from tests.support.routers import polled
from tests.unit.test_gateway_learning import Store, ep

EPS = {"e1": None, "e2": None}


def pairs(view):
    """What `view` reads of its siblings' entries: (endpoint, keys) each."""
    return [(s.endpoint, s.keys) for s in view.siblings_sent(EPS)]


def views(n, words=64):
    master = SentLog.create(key_of, words)
    return [master.for_row(r) for r in range(n)]


def test_a_worker_reads_its_siblings_entries_once_and_never_its_own():
    a, b, c = views(3)
    a.append("e1", [1, 2, 3])
    b.append("e2", [4])
    assert pairs(c) == [("e1", [1, 2, 3]), ("e2", [4])]
    assert pairs(c) == []
    assert pairs(a) == [("e2", [4])]
    assert pairs(b) == [("e1", [1, 2, 3])]


def test_entries_for_unknown_endpoints_are_dropped():
    a, b = views(2)
    a.append("gone", [7, 8])
    a.append("e1", [9])
    assert pairs(b) == [("e1", [9])]


def test_entries_wrap_around_the_ring_end():
    a, b = views(2, words=16)
    for i in range(10):  # 7 words each: the ring wraps every 2 or 3 entries
        a.append("e1", [i, i + 100, i + 200])
        assert pairs(b) == [("e1", [i, i + 100, i + 200])]


def test_a_reader_that_fell_a_ring_behind_loses_what_it_missed_and_goes_on():
    a, b = views(2, words=16)
    for i in range(5):
        a.append("e1", [i, i, i])
    assert pairs(b) == []  # overrun: nothing misread
    a.append("e2", [42])
    assert pairs(b) == [("e2", [42])]


def test_the_table_carries_the_log_to_every_workers_view():
    master = SharedCounts.create(2)
    a, b = (master.for_row(master.claim_row()) for _ in range(2))
    a.sent.append("e1", [5])
    assert pairs(b.sent) == [("e1", [5])]


def test_two_workers_agree_on_where_a_conversation_went():
    """Worker one routes a turn; worker two, taking the next one, finds the endpoint that holds it."""
    master = SharedCounts.create(2)
    views_ = [master.for_row(master.claim_row()) for _ in range(2)]
    clock = FakeClock()
    store = Store([ep(f"x{i}", capacity=8) for i in range(4)])
    (one, one_polls), (two, two_polls) = (polled(store, GatewaySettings(seed=1), clock, shared=v)
                                          for v in views_)
    for polls in (one_polls, two_polls):
        polls.refresh_endpoints()
    body = {"model": "m", "messages": [{"role": "system", "content": "policy " * 300}, {"role": "user", "content": "hi"}]}
    keys, tokens = prefix_of(body, CHAT, "m")
    first = one.route(RouteRequest("m", prefix=keys, prompt_tokens=tokens))
    assert isinstance(first, Choice)
    body["messages"] += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}]
    keys2, tokens2 = prefix_of(body, CHAT, "m")
    clock.advance(2.0)  # the next turn comes once the first was answered (its prefill long done)
    second = two.route(RouteRequest("m", prefix=keys2, prompt_tokens=tokens2))
    assert isinstance(second, Choice)
    assert second.endpoint.id == first.endpoint.id and second.matched >= len(keys) * 16 * 0.9


def test_an_entry_carries_when_it_was_sent_and_the_prefill_it_needed():
    a, b = views(2)
    a.append("e1", [1, 2], at=1234.5, prefill=0.375)
    [sent] = b.siblings_sent(EPS)
    assert (sent.endpoint, sent.keys, sent.at, sent.prefill) == ("e1", [1, 2], 1234.5, 0.375)
