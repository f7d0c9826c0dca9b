"""Which running answer a waiting request evicts (gateway.routing.eviction.evict), as a table."""

from __future__ import annotations

import pytest

from gateway.routing.eviction import BATCH, Evict, Keep, Running, Settings, Waiting, evict

S = Settings(enabled=True, margin=0.5, min_run=1.0, max_evictions=2)


def run(ident, key="heavy", klass="standard", counter=1000.0, tokens=50, running_for=5.0, evictions=0, fixed=None,
        endpoint="e1"):
    return Running(ident, endpoint, klass, key, counter, tokens, running_for, evictions, fixed)


LIGHT = Waiting("standard", "light", counter=900.0, turn=100.0)


@pytest.mark.parametrize("waiting, running, expect", [
    # in the same class, a key behind by more than half its request's cost evicts
    (LIGHT, [run(1)], 1),
    (Waiting("standard", "light", 960.0, 100.0), [run(1)], None),  # 40 behind: within the margin
    (Waiting("standard", "heavy", 0.0, 100.0), [run(1)], None),  # its own key's answers: never
    # a higher class always outranks; a lower never does
    (Waiting("critical", "heavy2", 5000.0, 100.0), [run(1)], 1),
    (Waiting("sheddable", "light", 0.0, 100.0), [run(1)], None),
    # an interactive request over a batch line, whatever the counters
    (Waiting("sheddable", "light", 9999.0, 100.0), [run(1, klass=BATCH)], 1),
    # what may not be evicted: too young, evicted enough, cannot resume exactly
    (LIGHT, [run(1, running_for=0.5)], None),
    (LIGHT, [run(1, evictions=2)], None),
    (LIGHT, [run(1, fixed="logprobs were asked for")], None),
    # the victim: fewest tokens, then the key most over its share
    (LIGHT, [run(1, tokens=80), run(2, tokens=20), run(3, tokens=50)], 2),
    (LIGHT, [run(1, tokens=20, counter=1000.0), run(2, key="other", tokens=20, counter=3000.0)], 2),
    # only where the waiting request may be sent
    (Waiting("standard", "light", 900.0, 100.0, frozenset({"e2"})), [run(1, tokens=1), run(2, endpoint="e2")], 2),
])
def test_evict_table(waiting, running, expect):
    got = evict(waiting, running, S)
    if expect is None:
        assert isinstance(got, Keep) and got.reason
    else:
        assert isinstance(got, Evict) and got.victim.ident == expect and got.reason


def test_keep_says_why():
    assert "too" not in evict(LIGHT, [], S).reason and "no answer runs" in evict(LIGHT, [], S).reason
    assert "minimum" in evict(LIGHT, [run(1, running_for=0.1)], S).reason
    assert "evicted 2 times" in evict(LIGHT, [run(1, evictions=2)], S).reason
    assert "logprobs" in evict(LIGHT, [run(1, fixed="logprobs were asked for")], S).reason
    assert "outranks no" in evict(Waiting("sheddable", "x", 0.0, 1.0), [run(1)], S).reason
    assert "off" in evict(LIGHT, [run(1)], Settings(enabled=False)).reason
