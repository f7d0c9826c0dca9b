"""The console's traffic charts (gateway.observe.traffic) and the saturation events
(gateway.observe.saturation): pure tables. The gateway counting real requests is
tests/integration/test_gateway_traffic.py."""

from __future__ import annotations

import pytest

from gateway.observe.saturation import Episode, News, step
from gateway.observe.traffic import BOUNDS, SLOT, SLOTS, TrafficCounter, bucket, series
from tests.support.clock import FakeClock


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
