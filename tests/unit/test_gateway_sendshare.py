"""What a gateway sent where and what it holds, shared with the other gateways through Redis
(gateway.server.sendshare, llmgw.state.store.sends, gateway.routing.othergateways): the stream's encoding,
the outbox of what a router sent and what the exchange (gateway.routing.exchange) learns from the
others' sends and counts, and one pass of the exchange between two gateways (fakeredis: one module at
a time)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from gateway.config import RoutingConfig
from gateway.routing.choice import FIRST_TOKEN, Choice, RouteRequest
from gateway.routing.exchange import Exchange
from gateway.routing.inflight import InFlight
from gateway.routing.prefixkeys import prefix_of
from gateway.routing.router import Router
from gateway.routing.tables import tables_from
from gateway.server.sendshare import SendShare
from llmgw.state import keys
from llmgw.state.demand_records import GatewayHolds, GatewaySent
from llmgw.state.records import EndpointInfo
from llmgw.surface import CHAT
from tests.support.clock import FakeClock

CFG = RoutingConfig(evict_weight=0)
SYSTEM = "You are the billing assistant. " + "Refunds need an order number and a reason. " * 80


def ep(i: str) -> EndpointInfo:
    return EndpointInfo(id=i, url=f"http://e/{i}", models=("m",), engine="sim", capacity=8, model="m")


def gateway(clock: FakeClock, endpoints=("a", "b", "c", "d"), shares: bool = False,
            cfg: RoutingConfig = CFG) -> tuple[Router, Exchange]:
    """A gateway process's router and its exchange over the same counts (`shares`: with an outbox)."""
    counts = InFlight(outbox=shares)
    r = Router(cfg, clock, random.Random(0), counts)
    tables = tables_from(1, "fp", [ep(i) for i in endpoints],
                         SimpleNamespace(canonical={}, groups=[("m",)], cold_start={}), {})
    r.apply_tables(tables, True)
    return r, Exchange(counts, lambda: r.tables, clock, says_holds=cfg.policy == "llmgw")


def turn(*questions: str) -> RouteRequest:
    msgs = [{"role": "system", "content": SYSTEM}]
    for q in questions:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": "the answer to " + q}]
    body = {"model": "m", "messages": msgs[:-1]}
    block_keys, tokens = prefix_of(body, CHAT, "m")
    return RouteRequest("m", prefix=block_keys, prompt_tokens=tokens, objective=FIRST_TOKEN)


def test_sends_cross_the_stream_intact_and_each_origin_has_its_own(store):
    s = store
    sent = [GatewaySent("a", [1, -2, 2**62, -(2**63)], 1000.25, 0.125), GatewaySent("b", [7], 1000.5, 0.0)]
    s.add_sends("gw-1", sent, 1000.5, 120)
    assert s.sending_origins(1000.5, 120) == ["gw-1"]
    cursors, read, got, holds = s.sends_after({"gw-1": "0-0"}, 100)
    assert (read, got, holds) == (1, sent, [])
    again = s.sends_after(cursors, 100)
    assert (again.read, again.sends, again.holds) == (0, [], [])  # read on from where it stopped
    assert s.sends_after({}, 100) == ({}, 0, [], [])  # nobody else shares: nothing is read
    assert 0 < s.r.pttl(keys.sends("gw-1")) <= 120_000  # a gateway that stops leaves nothing behind
    assert s.sending_origins(1000.5 + 121, 120) == [] and not s.r.exists(keys.SENDS_ORIGINS)


def test_an_unreadable_entry_is_skipped_and_what_follows_it_is_read(store):
    s = store
    s.r.xadd(keys.sends("gw-1"), {"d": '[["a", 1, 0, "not base64!"]]'})
    s.r.xadd(keys.sends("gw-1"), {"d": '{"a": 1}'})
    s.add_sends("gw-1", [GatewaySent("a", [5, 6], 1.0, 0.0)], 1.0, 120)
    s.r.xadd(keys.sends("gw-1"), {"h": '{"at": 2.0, "n": {"a": -1}}', "d": '[["b", 2, 0, "BwAAAAAAAAA="]]'})
    s.r.xadd(keys.sends("gw-1"), {"h": '{"n": {"a": 1}}'})
    s.add_sends("gw-1", [], 3.0, 120, holds={"a": 2})
    _, read, got, holds = s.sends_after({"gw-1": "0-0"}, 100)
    # an unreadable part of an entry costs nothing else of it, nor the entries after it
    assert read == 6 and got == [GatewaySent("a", [5, 6], 1.0, 0.0), GatewaySent("b", [7], 2.0, 0.0)]
    assert holds == [GatewayHolds("gw-1", 3.0, {"a": 2})]


def test_another_gateways_send_makes_the_next_turn_match_there_and_counts_in_its_backlog():
    clock = FakeClock(t=5000.0, mono=100.0)
    (one, one_x), (two, two_x) = gateway(clock, shares=True), gateway(clock)
    first = one.route(turn("where is my refund?"))
    assert isinstance(first, Choice) and first.prefill > 0
    ours = one_x.take_sends()
    assert [(s.endpoint, s.at) for s in ours] == [(first.endpoint.id, 5000.0)]
    assert one_x.take_sends() == []  # taken once
    assert two_x.take_sends() == [] and not two_x.shares_sends  # a gateway that does not share keeps nothing
    nxt = turn("where is my refund?", "and how long will it take?")
    blind = two.route(nxt)
    assert isinstance(blind, Choice) and blind.matched == 0  # the second gateway knows nothing of it
    two.release(blind, None)
    two.counts.backlog.done_at.clear()
    two_x.learn_sends(ours)
    assert two.counts.backlog.ahead(["a", "b", "c", "d"], clock.monotonic()) == pytest.approx({first.endpoint.id: first.prefill})
    later = two.route(nxt)
    assert isinstance(later, Choice) and later.endpoint.id == first.endpoint.id
    assert later.matched >= len(ours[0].keys) - 1  # the history the first gateway sent there


def test_a_send_long_past_adds_no_backlog_and_an_unlisted_endpoint_is_ignored():
    clock = FakeClock(t=5000.0, mono=100.0)
    r, x = gateway(clock, ("a", "b"))
    x.learn_sends([GatewaySent("a", [11, 12], 4990.0, 2.0), GatewaySent("gone", [13], 5000.0, 2.0)])
    assert r.counts.backlog.ahead(["a", "b", "gone"], clock.monotonic()) == {}
    assert set(r.counts.prefixes.by_ep) == {"a"}


def test_one_pass_publishes_ours_and_learns_only_the_other_gateways(store):
    s = store
    clock = FakeClock(t=5000.0, mono=100.0)
    gateways = [gateway(clock, shares=True) for _ in range(3)]
    routers = [r for r, _ in gateways]
    # The first two are workers of one gateway (one origin: they share sends in memory), the third another.
    shares = [SendShare(s, x, clock, 0.05, origin)
              for (_, x), origin in zip(gateways, ("gw-1", "gw-1", "gw-2"))]
    assert shares[0].step() is None  # nobody else shares yet: nothing read
    chosen = routers[0].route(turn("first question"))
    assert isinstance(chosen, Choice)
    assert shares[0].step() is None
    assert shares[1].step() is None  # a sibling: learned in memory, not from Redis
    assert not s.r.exists("llmgw:sends:gw-1")  # alone, a gateway publishes nothing but its name
    assert shares[2].step() == 0  # gw-1 did not know of gw-2 yet: it kept its send in its outbox
    assert shares[0].step() == 0  # now it does, and publishes what it kept
    assert shares[2].step() == 1
    assert shares[2].step() == 0  # once
    assert routers[2].counts.prefixes.matches(["a", "b", "c", "d"], turn("first question").prefix) == {
        chosen.endpoint.id: len(turn("first question").prefix)}
    late = SendShare(s, gateway(clock, shares=True)[1], clock, 0.05, "gw-3")  # a gateway that starts now reads what the stream keeps
    assert late.step() == 1


# --- what the other gateways hold (gateway.routing.othergateways) ---------------------------------------------
def test_holds_cross_the_stream_with_the_sends_or_alone(store):
    s = store
    s.add_sends("gw-1", [GatewaySent("a", [5], 1.0, 0.0)], 1.0, 120, holds={"a": 3, "b": 1})
    s.add_sends("gw-1", [], 1.5, 120, holds={})  # it holds nothing now: said, so the others drop it
    s.add_sends("gw-1", [], 2.0, 120)  # nothing to say: no entry
    _, read, got, holds = s.sends_after({"gw-1": "0-0"}, 100)
    assert read == 2 and got == [GatewaySent("a", [5], 1.0, 0.0)]
    assert holds == [GatewayHolds("gw-1", 1.0, {"a": 3, "b": 1}), GatewayHolds("gw-1", 1.5, {})]


def test_another_gateways_requests_count_where_they_are_until_it_goes_silent():
    from gateway.routing.othergateways import STALE

    clock = FakeClock(t=5000.0, mono=100.0)
    r, x = gateway(clock, ("a", "b"))
    idle = RouteRequest("m")
    # The other gateway filled a (capacity 8) a moment ago; no scrape has shown it yet.
    x.learn_holds("gw-2", {"a": 8, "gone": 4}, 4999.95)
    assert r.counts.held(r.endpoints, clock.monotonic()) == {"a": 8}  # an endpoint we do not list is ignored
    for _ in range(3):
        c = r.route(idle)
        assert isinstance(c, Choice) and c.endpoint.id == "b" and c.ahead == r.counts.counts["b"] - 1
    assert r.counts.siblings("a", clock.monotonic()) == 8  # the concurrency an answer is learned at
    # A later report replaces the earlier one; an older one arriving late changes nothing.
    x.learn_holds("gw-2", {"a": 1}, 5000.0)
    x.learn_holds("gw-2", {"a": 8}, 4999.99)
    assert r.counts.held(r.endpoints, clock.monotonic())["a"] == 1
    # ... but the peak of the last seconds is what a scrape may show of theirs (never counted twice)
    assert r.counts.others_recent(["a", "b"], clock.monotonic()) == {"a": 8}
    clock.advance(STALE + 0.1)  # silent: gone, and its requests with it
    assert r.counts.held(r.endpoints, clock.monotonic()).get("a", 0) == 0
    assert r.counts.others_recent(["a", "b"], clock.monotonic()) == {}
    x.learn_holds("gw-2", {"a": 8}, clock.time() - STALE - 1)  # read from the stream's past: says nothing
    assert r.counts.held(r.endpoints, clock.monotonic()).get("a", 0) == 0


def test_a_gateway_says_what_it_holds_when_it_changes_and_again_while_it_holds_anything():
    from gateway.routing.othergateways import REPEAT

    clock = FakeClock(t=5000.0, mono=100.0)
    r, x = gateway(clock, ("a", "b"))
    assert x.take_holds() is None  # nothing held, nothing said yet
    c = r.route(RouteRequest("m"))
    x.learn_holds("gw-2", {"b": 5}, clock.time())
    assert x.take_holds() == {c.endpoint.id: 1}  # ours only: never what the others told us
    assert x.take_holds() is None
    clock.advance(REPEAT)
    assert x.take_holds() == {c.endpoint.id: 1}  # repeated, so the others do not take it for gone
    r.release(c, None)
    assert x.take_holds() == {}  # said once when it drops to nothing
    clock.advance(REPEAT)
    assert x.take_holds() is None
    # the benchmark baselines stand for peers whose instances share nothing
    baseline, baseline_x = gateway(clock, ("a", "b"), cfg=RoutingConfig(policy="least_inflight"))
    baseline.route(RouteRequest("m"))
    assert baseline_x.take_holds() is None


def test_one_pass_carries_a_gateways_holds_to_the_others_and_not_back(store):
    s = store
    clock = FakeClock(t=5000.0, mono=100.0)
    (one, one_x), (two, two_x) = gateway(clock, shares=True), gateway(clock, shares=True)
    shares = [SendShare(s, x, clock, 0.05, origin) for x, origin in ((one_x, "gw-1"), (two_x, "gw-2"))]
    for sh in shares:
        sh.step()  # each announces itself; the second sees the first
    chosen = one.route(turn("first question"))
    assert isinstance(chosen, Choice)
    shares[0].step()
    shares[1].step()
    assert two.counts.held(two.endpoints, clock.monotonic()) == {chosen.endpoint.id: 1}
    shares[0].step()  # gw-2 holds nothing of its own, so it says nothing: gw-1 counts its request once
    assert one.counts.held(one.endpoints, clock.monotonic()) == {chosen.endpoint.id: 1}
    assert not one.counts.remote


def test_a_scrape_that_shows_another_gateways_requests_does_not_count_them_twice():
    from gateway.routing.load import ahead_of
    from llmgw.state.records import LoadRecord

    clock = FakeClock(t=5000.0, mono=100.0)
    r, x = gateway(clock, ("a", "b"))
    x.learn_holds("gw-2", {"a": 3}, clock.time())
    clock.advance(0.2)
    r.apply_loads({"a": LoadRecord(replica_id="a", ts=clock.time() - 0.1, ok=True, running=3.0, waiting=0.0),
                   "b": LoadRecord(replica_id="b", ts=clock.time() - 0.1, ok=True, running=0.0, waiting=0.0)})
    held = r.counts.held(r.endpoints, clock.monotonic())
    a = r.tables.by_id["a"]
    assert ahead_of(a, r.loads["a"], held.get("a", 0), r.stats["a"]) == 3  # theirs, once
    # and a scrape showing more than they said is traffic from elsewhere, counted on top
    clock.advance(1.0)
    x.learn_holds("gw-2", {"a": 3}, clock.time())
    r.apply_loads({"a": LoadRecord(replica_id="a", ts=clock.time() - 0.1, ok=True, running=5.0, waiting=0.0),
                   "b": LoadRecord(replica_id="b", ts=clock.time() - 0.1, ok=True, running=0.0, waiting=0.0)})
    held = r.counts.held(r.endpoints, clock.monotonic())
    assert ahead_of(a, r.loads["a"], held.get("a", 0), r.stats["a"]) == 5
