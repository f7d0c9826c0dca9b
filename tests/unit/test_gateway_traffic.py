"""The console's traffic charts (gateway.traffic) and the saturation events (gateway.saturation): pure
tables, then the gateway counting real requests on fakeredis and a fake engine."""

from __future__ import annotations

import time

import pytest

from gateway.observe.saturation import Episode, News, step
from gateway.observe.traffic import BOUNDS, SLOT, SLOTS, TrafficCounter, bucket, series, slot_of
from llmgw.state import events, keys
from llmgw.state.records import LoadRecord
from tests.support.clock import FakeClock
from tests.unit.test_gateway_app import CHAT, NEVER_STALE, endpoint, make_app, server, store  # noqa: F401


def test_buckets_bound_each_value_within_a_quarter():
    for v in (0.0004, 0.001, 0.0123, 0.5, 3.0, 119.0):
        i = bucket(v)
        assert BOUNDS[i] >= v and (i == 0 or BOUNDS[i - 1] < v) and BOUNDS[i] <= max(v, 0.001) * 1.25 + 1e-12


def test_counts_become_points_per_slot_and_model():
    clock = FakeClock(t=SLOT * 1000 + 1)
    c = TrafficCounter(clock.time)
    for i in range(98):
        c.request("m", seconds=0.1)
        c.first_byte("m", 0.02)
    c.request("m", seconds=2.0)
    c.request("m", error=True, seconds=9.0)
    c.request("m", shed=True)
    c.request("other", error=True)
    taken = c.take()
    assert c.take() == {}  # counts move out once
    assert taken[1000]["m:n"] == 101 and taken[1000]["m:err"] == 1 and taken[1000]["m:shed"] == 1
    stored = {s: {k: str(v) for k, v in f.items()} for s, f in taken.items()}  # as Redis hands them back
    got = series(stored, last_slot=1000)
    assert len(got["m"]) == SLOTS and got["m"][-1]["t"] == 1000 * SLOT
    last = got["m"][-1]
    assert last["rps"] == 101 / SLOT and last["errors"] == 1 / SLOT and last["sheds"] == 1 / SLOT
    # 100 latencies: 98 of 0.1 s, one of 2 s, one of 9 s: the 99th is 2 s
    assert 0.1 <= last["p50"] <= 0.125 and 2.0 <= last["p99"] <= 2.5
    assert 0.02 <= last["ttft_p50"] <= 0.025
    assert got["m"][0] == {"t": (1000 - SLOTS + 1) * SLOT, "rps": 0, "errors": 0, "sheds": 0, "p50": None,
                           "p99": None, "ttft_p50": None, "ttft_p99": None}
    assert got["other"][-1]["errors"] == 1 / SLOT and got["other"][-1]["p50"] is None


@pytest.mark.parametrize("name,episodes,signals,now,want_eps,want_news", [
    ("first signal opens an episode", {}, {"m": (2, 1)}, 10.0,
     {"m": Episode(10.0, 10.0, 2, 1)}, [News("model_saturated", "m",
                                             "every endpoint is saturated: 2 request(s) queued, 1 shed so far", 2, 1)]),
    ("more signals only count", {"m": Episode(10.0, 10.0, 2, 1)}, {"m": (0, 5)}, 12.0,
     {"m": Episode(10.0, 12.0, 2, 6)}, []),
    ("quiet, but not for long enough", {"m": Episode(10.0, 12.0, 2, 6)}, {}, 16.9,
     {"m": Episode(10.0, 12.0, 2, 6)}, []),
    ("quiet for QUIET seconds: recovered", {"m": Episode(10.0, 12.0, 2, 6)}, {}, 17.0,
     {}, [News("model_recovered", "m", "saturated for 2s: 2 request(s) queued, 6 shed", 2, 6)]),
    ("models are independent", {"a": Episode(1.0, 1.0, 1, 0)}, {"b": (1, 0)}, 2.0,
     {"a": Episode(1.0, 1.0, 1, 0), "b": Episode(2.0, 2.0, 1, 0)},
     [News("model_saturated", "b", "every endpoint is saturated: 1 request(s) queued, 0 shed so far", 1, 0)]),
])
def test_saturation_episodes(name, episodes, signals, now, want_eps, want_news):
    assert step(episodes, signals, now) == (want_eps, want_news)


def test_the_gateway_counts_requests_and_a_shed_storm_is_one_event(store, upstreams):  # noqa: F811
    up = upstreams()
    clock = FakeClock(2_000_000_000.0, real_monotonic=True)
    _, gw, c = make_app(store, [endpoint("e1", up.url)], clock=clock, routing=NEVER_STALE)
    _, gw2, c2 = make_app(store, [endpoint("e1", up.url)], clock=clock, routing=NEVER_STALE)  # another process
    assert c.post(CHAT, json={"model": "m-alias", "messages": []}).status_code == 200
    assert c.post(CHAT, json={"model": "nope"}).status_code == 404  # unknown names are never counted
    store.write_load(LoadRecord("e1", time.time(), True, running=4, waiting=9))
    for g in (gw, gw2):
        g.router.refresh_loads()
    for client in (c, c2):
        for _ in range(3):
            r = client.post(CHAT, json={"model": "m"}, headers={"X-LLMGW-Priority": "sheddable"})
            assert r.status_code == 429
    gw.background.flush_traffic()
    gw2.background.flush_traffic()
    slot = store.r.hgetall(keys.traffic(slot_of(clock.t)))
    assert slot["m:n"] == "7" and slot["m:shed"] == "6" and "m:err" not in slot
    assert sum(int(v) for k, v in slot.items() if k.startswith("m:lat")) == 1
    assert sum(int(v) for k, v in slot.items() if k.startswith("m:ttft")) == 1
    saturated = [e for e in events.latest(store.r) if e.kind == "model_saturated"]
    assert len(saturated) == 1 and saturated[0].model == "m" and "3 shed" in saturated[0].message
    assert saturated[0].source == f"gateway:{gw.identity.id}"
    clock.t += 6  # quiet for longer than QUIET
    gw.background.flush_traffic()
    (recovered,) = [e for e in events.latest(store.r) if e.kind == "model_recovered"]
    assert recovered.data == {"queued": 0, "shed": 3}
