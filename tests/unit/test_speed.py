"""The learned speed of an endpoint (gateway/speed.py): the fit, its error, the pull toward the
fleet, and the expected completion it gives the router."""

import math

import pytest

from gateway.routing.speed import PRIOR_SLOWDOWN, Fit, Speed, shrink

HL = 10.0  # half-life of samples, seconds


def fit(samples, t0=0.0, dt=0.1):
    f = Fit()
    for i, (x, y) in enumerate(samples):
        f = f.add(x, y, t0 + i * dt, HL)
    return f


def test_a_line_through_samples_at_several_concurrencies():
    # a decode step of 10 ms growing 10 % per extra sequence
    f = fit([(c, 0.010 * (1 + 0.1 * (c - 1))) for c in (1, 2, 4, 8, 3, 6, 5, 7)] * 3)
    y1, a = f.line()
    assert y1 == pytest.approx(0.010, rel=0.05) and a == pytest.approx(0.1, rel=0.1)


def test_samples_at_one_concurrency_keep_the_prior_slowdown():
    y1, a = fit([(4, 1.15)] * 5).line()
    assert a == pytest.approx(PRIOR_SLOWDOWN)
    assert y1 * (1 + a * 3) == pytest.approx(1.15)  # the level where the samples are is kept
    assert Fit().line() is None


def test_old_samples_fade_with_the_half_life():
    f = Fit().add(1, 1.0, 0.0, HL).add(1, 3.0, HL, HL)  # the first weighs half when the second comes
    assert f.w == pytest.approx(1.5) and f.sy / f.w == pytest.approx((0.5 * 1 + 3) / 1.5)


def test_error_shrinks_with_agreeing_samples_but_not_to_nothing():
    few, many = fit([(2, 1.0), (2, 1.0)]), fit([(2, 1.0)] * 40)
    noisy = fit([(2, 1.0 + (0.5 if i % 2 else -0.5)) for i in range(40)])
    assert 0.1 < few.error() < 1.0  # two samples that agree by chance are not certainty
    assert many.error() < few.error() and noisy.error() > many.error()
    assert Fit().error() == 1.0


def test_shrink_merges_what_noise_cannot_tell_apart_and_keeps_real_differences():
    same = shrink([(Speed(0.62, 0.1), 0.05), (Speed(0.66, 0.1), 0.05), (Speed(0.60, 0.1), 0.05)])
    assert max(s.decode1 for s in same) / min(s.decode1 for s in same) < 1.02
    apart = shrink([(Speed(0.64, 0.1), 0.05), (Speed(1.28, 0.1), 0.05), (Speed(2.56, 0.1), 0.05)])
    assert [round(s.decode1, 1) for s in apart] == [0.6, 1.3, 2.6]
    lone = Speed(1.0, 0.2)
    assert shrink([(lone, 0.5)]) == [lone]
    # an uncertain estimate moves toward a certain one, not the other way round
    a, b = shrink([(Speed(1.0, 0.1), 0.01), (Speed(1.5, 0.1), 1.0)])
    assert a.decode1 == pytest.approx(1.0, rel=0.01) and b.decode1 < 1.4


def test_completion_grows_with_the_batch_then_waits_for_a_slot():
    sp = Speed(1.0, 0.1, ttfb=0.05)
    assert sp.completion(0, 8) == pytest.approx(1.05)
    assert sp.completion(7, 8) == pytest.approx(0.05 + 1.7)  # a full batch of 8
    assert sp.completion(9, 8) == pytest.approx(0.05 + 2 * 1.7 / 8 + 1.7)  # two must finish first
    assert sp.completion(50, math.inf) == pytest.approx(0.05 + 6.0)  # no limit known: a batch of 51
    assert sp.imposed(3, 8) == pytest.approx(3 * 0.1 * 0.5) and sp.imposed(8, 8) == 0.0
    assert sp.rate(8) == pytest.approx(8 / 1.7) and sp.rate(math.inf) == math.inf


def test_a_slow_estimate_is_relaxed_toward_the_best():
    best, slow = Speed(1.0, 0.1), Speed(3.0, 0.2)
    assert slow.relaxed_toward(best, 0.5).decode1 == pytest.approx(2.0)
    assert best.relaxed_toward(slow, 0.5) is best


def level(f, x=4):
    y1, a = f.line()
    return y1 * (1 + a * (x - 1))


def test_an_engine_that_slows_down_is_seen_two_samples_later():
    """A scrape a second: 20 s of a steady engine, then it runs at 30 % of its speed. With only the
    half-life (10 s) the estimate would be about 0.018 two samples later, less than half the new time."""
    steady = fit([(4, 0.013 * (1 + 0.02 * (i % 3 - 1))) for i in range(20)], dt=1.0)
    f = steady.add(4, 0.013 / 0.3, 20.0, HL)
    assert level(f) < 0.02  # one stray sample moves it little
    f = f.add(4, 0.013 / 0.3, 21.0, HL)
    assert level(f) == pytest.approx(0.013 / 0.3, rel=0.25)


def test_one_stray_sample_or_ordinary_scatter_is_not_a_change():
    import random

    rng = random.Random(3)
    f = Fit()
    for i in range(300):  # 30 % scatter (answers of different lengths), and one pause in a while
        y = 1.0 * rng.lognormvariate(0, 0.3) * (4 if i % 50 == 49 else 1)
        f = f.add(4, y, i * 0.5, HL)
        assert f.surprises in (0, 1)
    assert level(f) == pytest.approx(1.0 * math.exp(0.045), rel=0.25)


def test_a_recovered_engine_is_seen_as_fast_again():
    f = fit([(4, 0.04)] * 20, dt=1.0)
    f = f.add(4, 0.013, 20.0, HL).add(4, 0.013, 21.0, HL)
    assert level(f) == pytest.approx(0.013, rel=0.25)
