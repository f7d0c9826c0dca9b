"""Eviction across gateways: the asks (gateway.routing.remote_eviction), their exchange through the store
(fakeredis) and the look that answers them (gateway.server.remote_evictions), and the slot a claim grants
(choice.RouteRequest.granted)."""

from __future__ import annotations

import random

import fakeredis

from gateway.config import RoutingConfig
from gateway.routing.choice import Choice, RouteContext, RouteRequest, choose
from gateway.routing.eviction import Running, Settings, Waiting
from gateway.routing.remote_eviction import GRANT_FOR, STALE, Ask, Asks, answer, decode, encode
from gateway.server.remote_evictions import LEND, RemoteEvictions
from llmgw.state.records import EndpointInfo
from llmgw.state.store import Store

S = Settings(enabled=True, margin=0.5, min_run=0.25, max_evictions=2)
LIGHT = Waiting("standard", "light", counter=10.0, turn=20.0)
NOW = 2_000_000_000.0


def run(ident, key="heavy", counter=1000.0, tokens=30, endpoint="e1", klass="standard"):
    return Running(ident, endpoint, klass, key, counter, tokens, 5.0)


def ask(asker="gw2/1", origin="gw2", model="m", seq=1, waiting=LIGHT, at=NOW):
    return Ask(asker, origin, model, seq, waiting, at)


def test_an_ask_reads_back_as_written_and_a_cut_one_is_not_answered():
    a = ask(waiting=Waiting("sheddable", "k", 1.5, 2.0, frozenset({"e2", "e1"}), -0.25))
    assert decode(a.asker, a.model, encode(a)) == a
    assert decode(a.asker, a.model, encode(ask())) == ask()
    assert decode("x", "m", encode(a)[:-3]) is None
    assert decode("x", "m", '{"o": "g"}') is None


def test_the_other_gateways_fresh_asks_are_answered_each_with_its_own_victim():
    running = {"m": [run(1, tokens=40), run(2, tokens=10), run(3, tokens=25)]}
    got = answer([ask("gw2/1"), ask("gw3/1", "gw3")], "gw1", running, S, NOW + 0.1)
    assert [(a.asker, e.victim.ident) for a, e in got] == [("gw2/1", 2), ("gw3/1", 3)]
    # a request that ranks first chooses first: the critical ask takes the cheapest victim
    crit = ask("gw3/1", "gw3", waiting=Waiting("critical", "other", 5000.0, 20.0))
    got = answer([ask("gw2/1"), crit], "gw1", running, S, NOW)
    assert [(a.asker, e.victim.ident) for a, e in got] == [("gw3/1", 2), ("gw2/1", 3)]
    # our own gateway's asks are the board's; a stale ask's worker stopped asking; another model's
    assert answer([ask(origin="gw1")], "gw1", running, S, NOW) == []
    assert answer([ask(at=NOW - STALE - 0.1)], "gw1", running, S, NOW) == []
    assert answer([ask(model="other")], "gw1", running, S, NOW) == []
    # The asking key counts as the more served of its gateway's view and ours: a view that had not seen
    # its latest charges yet does not let it evict an answer of a key it does not trail.
    ours = {("m", "light"): 995.0}
    assert answer([ask()], "gw1", running, S, NOW, lambda m, k: ours.get((m, k), 0.0)) == []
    assert len(answer([ask()], "gw1", running, S, NOW, lambda m, k: 0.0)) == 1  # ours lower: the ask's stands
    # an ask that outranks nothing here takes nothing
    assert answer([ask(waiting=Waiting("standard", "light", 999.0, 20.0))], "gw1", running, S, NOW) == []


def test_an_ask_lives_while_its_request_waits_and_a_claim_grants_that_request_alone():
    asks = Asks("gw2/1", "gw2")
    owner, other = set(), set()
    asks.ask("m", LIGHT, owner)
    post, withdrawn, claims = asks.due(NOW, 10.0)
    assert list(post) == ["m"] and withdrawn == [] and claims == [("m", 1)]
    assert decode("gw2/1", "m", post["m"]) == ask(seq=1)
    assert not asks.claimed("m", 7, "e1", 10.0)  # another seq's claim grants nothing
    assert asks.claimed("m", 1, "e1", 10.0)
    assert asks.granted("m", owner, 10.1) == "e1" and asks.granted("m", other, 10.1) is None
    post, _, claims = asks.due(NOW, 10.2)
    assert post == {} and claims == []  # answered: not posted again while the grant holds
    # unused for GRANT_FOR (another request took that slot): asked again under a new seq
    assert asks.granted("m", owner, 10.0 + GRANT_FOR + 0.1) is None
    post, _, claims = asks.due(NOW, 10.0 + GRANT_FOR + 0.1)
    assert claims == [("m", 2)] and decode("gw2/1", "m", post["m"]).seq == 2
    # only its own request takes it back
    asks.withdraw("m", other)
    assert asks.busy and "m" in asks.mine
    asks.withdraw("m", owner)
    assert asks.due(NOW, 12.0) == ({}, ["m"], [])
    assert not asks.busy
    asks.took_back(["m"])  # Redis failed before it was taken back there: the next look does it
    assert asks.due(NOW, 12.1) == ({}, ["m"], [])


class FakeAnswers:
    def __init__(self, running):
        self.settings, self.busy = S, True
        self.running, self.evicted = running, []

    def models(self):
        return set(self.running)

    def running_all(self):
        return self.running

    def evict_for(self, ident, reason):
        self.evicted.append((ident, reason))
        return True

    def counter(self, model, key):
        return 0.0


class Clock:
    def __init__(self):
        self.t = 100.0

    def monotonic(self):
        return self.t

    def time(self):
        return NOW + self.t


def test_two_gateways_looks_evict_once_per_ask_and_hold_the_slot_for_the_asker():
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    clock = Clock()
    woken, lent, given = [], [], []

    def lend(endpoint):
        lent.append(endpoint)
        return lambda: given.append(endpoint)

    asks2 = Asks("gw2/7", "gw2")
    asker = RemoteEvictions(store, asks2, FakeAnswers({}), clock, 0.02, lambda: True, woken.append, lend)
    runs = {"m": [run(1, tokens=40), run(2, tokens=10)]}
    gw1a = RemoteEvictions(store, Asks("gw1/1", "gw1"), FakeAnswers(runs), clock, 0.02, lambda: True, woken.append,
                           lend)
    gw1b = RemoteEvictions(store, Asks("gw1/2", "gw1"), FakeAnswers(runs), clock, 0.02, lambda: True, woken.append,
                           lend)
    owner = set()
    asks2.ask("m", LIGHT, owner)
    assert gw1a.step() == 0  # nothing posted yet
    assert asker.step() == 0  # posts the ask
    assert gw1a.step() == 1 and gw1b.step() == 0  # one claim per ask: the second worker evicts nothing
    assert gw1a.answers.evicted[0][0] == 2 and "another gateway" in gw1a.answers.evicted[0][1]
    assert lent == ["e1"] and given == []
    assert asker.step() == 0 and woken == ["m"] and asks2.granted("m", owner, clock.t) == "e1"
    assert gw1a.step() == 0  # an answered ask is not answered again
    clock.t += LEND + 0.01
    gw1a.step()
    assert given == ["e1"]  # the lent slot is given back after LEND
    # alone (no other gateway shares), a look costs no I/O and answers nothing
    alone = RemoteEvictions(store, Asks("gw9/1", "gw9"), FakeAnswers(runs), clock, 0.02, lambda: False,
                            woken.append, lend)
    assert alone.step() == 0 and store.r.keys("llmgw:evict:claim:gw9*") == []


def _ep(i, capacity=2):
    return EndpointInfo(id=i, url=f"http://{i}", models=("m",), engine="sim", served_name="m", model="m",
                        capacity=capacity)


def test_a_granted_endpoint_takes_the_request_though_it_looks_full():
    eps = [_ep("e1"), _ep("e2")]
    full = {"e1": 2, "e2": 2}
    ctx = RouteContext(eps, {}, full, 0.0, random.Random(0), RoutingConfig())
    r = choose(ctx, RouteRequest("m"))
    assert not isinstance(r, Choice) and r.kind == "saturated"
    r = choose(ctx, RouteRequest("m", granted="e2"))
    assert isinstance(r, Choice) and r.endpoint.id == "e2"


def test_a_lent_slot_counts_as_held_until_it_is_given_back():
    from gateway.routing.router import Router
    from gateway.routing.tables import tables_from
    from llmgw.state.clock import Clock as Real
    from llmgw.state.store.catalog import CatalogOutline

    woken = []
    r = Router(RoutingConfig(), Real(), random.Random(1), on_release=woken.append)
    r.apply_tables(tables_from(1, "fp", [_ep("e1", capacity=1)], CatalogOutline(), {}), True)
    assert r.lend("gone") is None  # an endpoint no longer listed: nothing to hold
    give_back = r.lend("e1")
    got = r.route(RouteRequest("m"))
    assert not isinstance(got, Choice) and got.kind == "saturated"  # our waiters leave it to the asker
    woken.clear()
    give_back()
    assert woken == ["m"]  # the model's queues try again
    assert isinstance(r.route(RouteRequest("m")), Choice)
