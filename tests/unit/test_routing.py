"""`choose` on tables of endpoints and loads: tiers, saturation, stale loads, weights, speeds,
affinity, near-tie spreading, and the benchmark policies."""

import random
from collections import Counter

import pytest

from gateway.config import RoutingConfig
from gateway.routing.choice import Choice, Rejection, RouteContext, RouteRequest, policy_of, score
from gateway.routing.choice import choose as choose_in
from gateway.routing.load import EndpointStats
from gateway.routing.speed import Speed
from llmgw.state.records import EndpointInfo, LoadRecord


def choose(endpoints, loads, inflight, request, now, *, rng, stats=None, cfg=RoutingConfig(), policy=None,
           matched=None, exact=frozenset(), backlog=None):
    """The routing decision over the values it reads (gateway.routing.choice.RouteContext)."""
    return choose_in(RouteContext(endpoints, loads, inflight, now, rng, cfg, stats or {}, policy, matched, exact,
                                  backlog), request)

NOW = 1000.0
CFG = RoutingConfig()


def ep(i, models=("m",), priority=0, weight=1.0, capacity=4):
    return EndpointInfo(id=i, url=f"http://e/{i}", models=tuple(models), engine="sim", priority=priority,
                        weight=weight, capacity=capacity, model=models[0])


def load(i, running=0, waiting=0, kv=None, ts=NOW, ok=True):
    return LoadRecord(replica_id=i, ts=ts, ok=ok, running=running, waiting=waiting, kv_usage=kv)


def known(seconds, at=NOW, **kw):
    """An endpoint whose requests take `seconds` at any concurrency below its slots (no slowdown)."""
    return EndpointStats(speed=Speed(seconds, 0.0), last_sample=at, **kw)


def pick(eps, loads=(), inflight=None, req=None, stats=None, seed=0, cfg=CFG, **kw):
    return choose(eps, {l.replica_id: l for l in loads}, inflight or {}, req or RouteRequest("m"), NOW,
                  stats=stats, cfg=cfg, rng=random.Random(seed), **kw)


def test_unknown_model_and_all_excluded():
    assert pick([ep("a")], req=RouteRequest("other")) == Rejection("unknown_model", "other")
    r = pick([ep("a")], req=RouteRequest("m", exclude=frozenset({"a"})))
    assert isinstance(r, Rejection) and r.kind == "no_ready"


def test_aliases_are_candidates():
    assert pick([ep("a", models=("m", "alias"))], req=RouteRequest("alias")).endpoint.id == "a"


@pytest.mark.parametrize(
    "loads, inflight, expect",
    [
        # scraped queue: b is emptier
        ([load("a", running=4, waiting=3), load("b", running=1)], {}, "b"),
        # our own in-flight count counts even before any scrape shows it
        ([], {"a": 3}, "b"),
        # a stale record is ignored (would otherwise make b look busy)
        ([load("b", running=4, waiting=4, ts=NOW - 10)], {"a": 2}, "b"),
        # a failed scrape is ignored too
        ([load("b", running=4, waiting=4, ok=False)], {"a": 2}, "b"),
        # high KV usage on a saturates it
        ([load("a", kv=0.95)], {"b": 2}, "b"),
        # waiting >= 5 saturates a even though b holds more of ours
        ([load("a", waiting=5)], {"b": 3}, "b"),
    ],
)
def test_load_signal(loads, inflight, expect):
    assert pick([ep("a"), ep("b")], loads, inflight).endpoint.id == expect


def test_capacity_saturates_by_inflight():
    r = pick([ep("a", capacity=2), ep("b", capacity=2)], inflight={"a": 2, "b": 1})
    assert r.endpoint.id == "b"
    r = pick([ep("a", capacity=2), ep("b", capacity=2)], inflight={"a": 2, "b": 2})
    assert r == Rejection("saturated", "m", "all 2 endpoints saturated")


def test_standard_waits_for_a_full_fast_endpoint_rather_than_a_slow_one():
    eps = [ep("fast", capacity=4), ep("slow", capacity=4)]
    stats = {"fast": known(0.1), "slow": known(0.8)}
    r = pick(eps, inflight={"fast": 4}, stats=stats)
    assert (r.kind, r.detail) == ("saturated", "deferred: a faster endpoint frees sooner")
    # The deferral says when time alone ends it (the queue looks again then, not on a poll).
    assert r.retry_in is not None and 0 < r.retry_in < 5
    before = pick(eps, inflight={"fast": 4}, stats=stats, req=RouteRequest("m", waited=r.retry_in - 0.01))
    assert isinstance(before, Rejection) and abs(before.retry_in - 0.01) < 1e-6
    assert pick(eps, inflight={"fast": 4}, stats=stats,
                req=RouteRequest("m", waited=r.retry_in + 0.01)).endpoint.id == "slow"
    # sheddable traffic is better served slowly than shed; critical takes the open endpoint too
    assert pick(eps, inflight={"fast": 4}, stats=stats, req=RouteRequest("m", "sheddable")).endpoint.id == "slow"
    # once the gateway's queue is long, the overflow goes to the slow endpoint
    r = pick(eps, inflight={"fast": 4}, stats=stats, req=RouteRequest("m", queued=40))
    assert r.endpoint.id == "slow"
    # a similar-speed open endpoint is used at once
    stats["slow"] = known(0.12)
    assert pick(eps, inflight={"fast": 4}, stats=stats).endpoint.id == "slow"


def test_critical_goes_to_least_loaded_past_saturation():
    r = pick([ep("a", capacity=2), ep("b", capacity=2)], inflight={"a": 5, "b": 2},
             req=RouteRequest("m", priority="critical"))
    assert isinstance(r, Choice) and r.endpoint.id == "b" and r.saturated


def test_priority_tiers_take_overflow_only():
    eps = [ep("gpu", priority=10, capacity=2), ep("cpu", priority=0, capacity=2)]
    # the high tier takes traffic even when the low one is idle ...
    assert pick(eps, inflight={"gpu": 1}).endpoint.id == "gpu"
    # ... until it is saturated
    assert pick(eps, inflight={"gpu": 2}).endpoint.id == "cpu"
    assert pick(eps, [load("gpu", waiting=6)]).endpoint.id == "cpu"


def test_learned_speed_beats_queue_length():
    """A fast endpoint with free slots wins over an idle slow one, even when it holds more requests;
    once what it holds (from every gateway) reaches its capacity, the slow one takes the overflow."""
    eps = [ep("fast", capacity=16), ep("slow", capacity=16)]
    stats = {"fast": known(0.1, scrape_inflight=0),
             "slow": known(0.4, scrape_inflight=0)}
    assert pick(eps, inflight={"fast": 3}, stats=stats).endpoint.id == "fast"
    # 8 held for other gateways: least-inflight would pick slow; expected delay still prefers fast
    busy = [load("fast", running=8, waiting=0)]
    assert pick(eps, busy, stats=stats).endpoint.id == "fast"
    assert pick(eps, busy, inflight={"fast": 3}, stats=stats).endpoint.id == "fast"  # 11 ahead
    full = [load("fast", running=16, waiting=0)]
    assert pick(eps, full, inflight={"fast": 1},
                stats={**stats, "slow": known(0.15)}).endpoint.id == "slow"


def test_weight_scales_the_score():
    eps = [ep("a", weight=1.0, capacity=None), ep("b", weight=3.0, capacity=None)]
    assert pick(eps, inflight={"a": 1, "b": 4}).endpoint.id == "b"
    eps = [ep("a", capacity=None), ep("b", capacity=None)]
    assert pick(eps, inflight={"a": 1, "b": 4}).endpoint.id == "a"


def test_unknown_speed_is_explored_and_old_slowness_forgotten():
    eps = [ep("known", capacity=1), ep("new", capacity=1)]
    stats = {"known": known(0.1)}
    assert pick(eps, inflight={"known": 1}, stats=stats).endpoint.id == "new"  # assumed as fast as the best
    # ... but only one probe at a time until its speed is learned
    assert pick(eps, inflight={"known": 1, "new": 1}, stats=stats, req=RouteRequest("m", "critical")).saturated
    cfg = RoutingConfig(forget_half_life=10)
    old = {"known": known(0.1), "slow": known(1.0, at=NOW - 100)}
    eps = [ep("known", capacity=1), ep("slow", capacity=1)]
    # ten half-lives later the slow estimate is nearly the best again: it gets a try when known is busy
    assert pick(eps, inflight={"known": 1}, stats=old, cfg=cfg).endpoint.id == "slow"


def test_other_gateways_traffic_from_scrape():
    """Scraped 6 running while we had 1 in flight at scrape time: 5 belong to others."""
    eps = [ep("a"), ep("b")]
    stats = {"a": known(0.1, scrape_inflight=1),
             "b": known(0.1, scrape_inflight=0)}
    r = pick(eps, [load("a", running=6), load("b", running=0)], {"a": 0, "b": 3}, stats=stats)
    assert r.endpoint.id == "b" and r.ahead == 3


def test_near_ties_are_spread_randomly():
    eps = [ep(f"e{i}") for i in range(4)]
    picks = Counter(pick(eps, seed=s).endpoint.id for s in range(400))
    assert set(picks) == {"e0", "e1", "e2", "e3"}
    assert min(picks.values()) > 60  # roughly uniform, no herding on the first endpoint


def test_seeded_choice_is_reproducible():
    eps = [ep(f"e{i}") for i in range(4)]
    assert [pick(eps, seed=7).endpoint.id for _ in range(5)] == [pick(eps, seed=7).endpoint.id] * 5


def test_affinity_sticks_until_overloaded():
    eps = [ep(f"e{i}", capacity=8) for i in range(4)]
    req = RouteRequest("m", affinity="session-42")
    home = pick(eps, req=req).endpoint.id
    assert all(pick(eps, inflight={home: 1}, req=req, seed=s).endpoint.id == home for s in range(20))
    # a different session can land elsewhere; sessions spread over the endpoints
    homes = {pick(eps, req=RouteRequest("m", affinity=f"s{i}")).endpoint.id for i in range(40)}
    assert len(homes) == 4
    # bounded load: once home holds far more than the mean, the session moves
    moved = pick(eps, inflight={home: 7}, req=req).endpoint.id
    assert moved != home


def test_affinity_survives_an_unrelated_endpoint_leaving():
    eps = [ep(f"e{i}") for i in range(5)]
    req = RouteRequest("m", affinity="abc")
    home = pick(eps, req=req).endpoint.id
    other = next(e for e in eps if e.id != home)
    assert pick([e for e in eps if e is not other], req=req).endpoint.id == home


def test_round_robin_and_least_inflight_policies():
    eps = [ep("a"), ep("b"), ep("c")]
    rr = RoutingConfig(policy="round_robin")
    turns = policy_of("round_robin")  # one router's instance: it keeps its own turn
    assert [pick(eps, cfg=rr, policy=turns).endpoint.id for _ in range(4)] == ["a", "b", "c", "a"]
    assert pick(eps, cfg=rr).endpoint.id == "a"  # a fresh instance starts at the first
    li = RoutingConfig(policy="least_inflight")
    assert pick(eps, inflight={"a": 2, "b": 0, "c": 1}, cfg=li).endpoint.id == "b"


def test_score_grows_with_the_batch_then_with_the_queue():
    """Below its slots a batching endpoint is not flat: each extra sequence slows every step (and the
    request slows the ones already running); past its slots it also waits for a slot."""
    sp = Speed(1.0, 0.1)
    d = [score(sp, n, 4, 1.0, None, CFG) for n in range(8)]
    assert d == sorted(d) and d[1] - d[0] == pytest.approx(0.1 + 0.05)  # own decode + imposed on one
    assert d[4] == pytest.approx(1.3 + 1.3 / 4)  # full batch of 4, and one of them must finish first
    assert score(sp, 0, 4, 1.0, 0.8, CFG) > score(sp, 0, 4, 1.0, None, CFG)  # KV pressure stretches it
    assert score(sp, 2, 4, 2.0, None, CFG) == pytest.approx(score(sp, 2, 4, 1.0, None, CFG) / 2)  # weight


def test_scrape_derived_speed_for_endpoints_we_never_served():
    """Another gateway's traffic shows in the token counters: a slow endpoint is known to be slow
    before this gateway ever sends it anything."""
    eps = [ep("fast", capacity=4), ep("slow", capacity=4)]
    stats = {"fast": known(0.1), "slow": known(0.8)}  # slow: from scrapes only (gateway.routing.learn)
    assert pick(eps, inflight={"fast": 3}, stats=stats).endpoint.id == "fast"
    assert pick(eps, inflight={"fast": 4}, stats=stats) == Rejection("saturated", "m", "deferred: a faster endpoint frees sooner")


def test_capacity_counts_other_processes_traffic():
    """Two gunicorn workers (or gateways) share a replica: the scrape shows the other's requests, and
    together they must not exceed its capacity."""
    eps = [ep("a", capacity=4)]
    stats = {"a": known(0.1, scrape_inflight=1)}
    # we hold 1; the engine runs 4 (3 of them another worker's): full, though our own count is 1
    r = pick(eps, [load("a", running=4)], inflight={"a": 1}, stats=stats)
    assert isinstance(r, Rejection) and r.kind == "saturated"
    crit = pick(eps, [load("a", running=4)], inflight={"a": 1}, stats=stats, req=RouteRequest("m", "critical"))
    assert crit.saturated and crit.ahead == 4
    assert pick(eps, [load("a", running=3)], inflight={"a": 1}, stats=stats).endpoint.id == "a"


def test_staleness_is_judged_by_when_this_gateway_saw_the_record():
    """The agent's clock may be far off ours: `load_seen` (our clock) decides, not the record's ts."""
    eps = [ep("a", capacity=None), ep("b", capacity=None)]
    skewed = [load("a", waiting=9, ts=NOW - 3600)]  # agent clock an hour behind, record just seen
    fresh = {"a": EndpointStats(load_seen=NOW - 1)}
    assert pick(eps, skewed, stats=fresh).endpoint.id == "b"  # the load counts: a is saturated
    ahead_clock = [load("a", waiting=9, ts=NOW + 3600)]  # agent clock ahead; we saw it 10 s ago
    old = {"a": EndpointStats(load_seen=NOW - 10)}
    r = pick(eps, ahead_clock, stats=old)
    assert r.ahead == 0  # stale: ignored, so a and b look equal
    assert {pick(eps, ahead_clock, stats=old, seed=s).endpoint.id for s in range(20)} == {"a", "b"}


def test_choose_requires_the_callers_rng():
    with pytest.raises(TypeError):
        choose([ep("a")], {}, {}, RouteRequest("m"), NOW)


def test_an_endpoint_that_refused_a_connection_is_passed_over_until_its_ejection_ends():
    eps = [ep("a"), ep("dead")]
    down = {"dead": EndpointStats(down_until=NOW + 5)}
    # Otherwise "dead" would win every time: it is idle, "a" holds three of ours.
    assert {pick(eps, inflight={"a": 3}, stats=down, seed=s).endpoint.id for s in range(20)} == {"a"}
    assert pick(eps, inflight={"a": 3}, seed=0).endpoint.id == "dead"
    # After the ejection it is a candidate again.
    over = {"dead": EndpointStats(down_until=NOW - 0.1)}
    assert pick(eps, inflight={"a": 3}, stats=over, seed=0).endpoint.id == "dead"
    # When every endpoint is ejected, one is still tried rather than refusing the request.
    all_down = {"a": EndpointStats(down_until=NOW + 5), "dead": EndpointStats(down_until=NOW + 5)}
    assert isinstance(pick(eps, stats=all_down), Choice)
