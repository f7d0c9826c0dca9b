"""The simulated engine's batching model, on a virtual clock."""

import pytest

from simengine.core import RequestTooLarge, SimConfig, SimCore, simulate

CFG = SimConfig(max_seqs=8, kv_tokens=100_000, step_ms=10.0, batch_alpha=0.1, prefill_ms_per_token=1.0)


def burst(n, prompt=20, out=50, at=0.0):
    return [(at, f"r{i}", prompt, out) for i in range(n)]


def test_single_request_timing_is_prefill_plus_decode_steps():
    t = simulate(CFG, burst(1, prompt=20, out=5))["r0"]
    assert t.ttft == pytest.approx(0.010 + 0.020)  # one step + 20 tokens of prefill
    assert t.e2e == pytest.approx(0.030 + 4 * 0.010)
    assert t.tokens == 5


def test_throughput_and_latency_grow_with_batch():
    one = simulate(CFG, burst(1))
    eight = simulate(CFG, burst(8))
    tps_one = 50 / max(t.e2e for t in one.values())
    tps_eight = 8 * 50 / max(t.e2e for t in eight.values())
    assert tps_eight > 4 * tps_one  # batching pays...
    assert min(t.e2e for t in eight.values()) > 1.5 * one["r0"].e2e  # ...but each request is slower
    assert CFG.decode_seconds(8) == pytest.approx(0.010 * 1.7)


def test_requests_beyond_max_seqs_wait_fifo():
    cfg = SimConfig(max_seqs=2, step_ms=10.0, batch_alpha=0.0, prefill_ms_per_token=0.0)
    core = SimCore(cfg)
    for i in range(5):
        core.submit(f"r{i}", 10, 3, now=0.0)
    step = core.plan_step()
    assert step.batch == ("r0", "r1") and (core.num_running, core.num_waiting) == (2, 3)
    timings = simulate(cfg, burst(5, prompt=10, out=3))
    assert timings["r2"].ttft == pytest.approx(timings["r0"].e2e + 0.010)  # starts when r0 leaves
    assert timings["r4"].e2e > timings["r2"].e2e > timings["r0"].e2e


def test_speed_factor_divides_every_duration():
    fast = SimConfig(**{**CFG.__dict__, "speed": 2.0})
    slow_t, fast_t = simulate(CFG, burst(4)), simulate(fast, burst(4))
    for rid in slow_t:
        assert fast_t[rid].e2e == pytest.approx(slow_t[rid].e2e / 2)


def test_kv_budget_makes_requests_wait_and_reports_usage():
    cfg = SimConfig(max_seqs=8, kv_tokens=100, step_ms=10.0, prefill_ms_per_token=0.0)
    core = SimCore(cfg)
    core.submit("a", 40, 20, 0.0)  # reserves 60
    core.submit("b", 30, 20, 0.0)  # would need 50 more: waits although a slot is free
    step = core.plan_step()
    assert step.batch == ("a",) and core.num_waiting == 1
    assert core.kv_usage == 0.0  # nothing prefilled yet
    core.finish_step(step, 0.01)
    assert core.kv_usage == pytest.approx(41 / 100)
    with pytest.raises(RequestTooLarge, match="at most 100"):
        core.submit("huge", 90, 20, 0.0)


def test_kv_usage_tracks_generated_tokens_and_frees_on_finish():
    core = SimCore(SimConfig(kv_tokens=1000))
    core.submit("a", 100, 3, 0.0)
    usage = []
    while (step := core.plan_step()) is not None:
        core.finish_step(step, 0.0)
        usage.append(core.kv_usage)
    assert usage == [pytest.approx(0.101), pytest.approx(0.102), 0.0]
    assert (core.prompt_tokens_total, core.generation_tokens_total, core.requests_finished) == (100, 3, 1)


def test_cancel_frees_the_slot_mid_step():
    core = SimCore(SimConfig(max_seqs=1))
    core.submit("a", 10, 100, 0.0)
    core.submit("b", 10, 2, 0.0)
    step = core.plan_step()
    core.cancel("a")
    assert core.finish_step(step, 0.1) == []  # a's token is dropped
    assert core.plan_step().batch == ("b",)


def test_deterministic():
    arrivals = [(i * 0.003, f"r{i}", 10 + i, 5 + i % 7) for i in range(40)]
    assert simulate(CFG, arrivals) == simulate(CFG, arrivals)


def test_bad_config_and_requests_are_refused():
    with pytest.raises(ValueError):
        SimConfig(max_seqs=0)
    with pytest.raises(ValueError):
        SimConfig(speed=0)
    with pytest.raises(ValueError):
        SimCore(CFG).submit("x", 10, 0, 0.0)


def test_slowdown_divides_durations_from_slow_after_seconds_past_the_first_arrival():
    cfg = SimConfig(max_seqs=4, step_ms=10.0, batch_alpha=0.0, prefill_ms_per_token=1.0, slow_to=0.25, slow_after=1.0)
    core = SimCore(cfg)
    core.submit("a", 10, 3, now=5.0)  # the clock starts here, not at 0
    before = core.plan_step(now=5.5)
    assert before.duration == pytest.approx(0.010 + 0.010) and before.decode == pytest.approx(0.010)
    after = core.plan_step(now=6.0)  # one second after the first arrival: four times slower
    assert after.duration == pytest.approx(4 * 0.020) and after.decode == pytest.approx(0.040)
    assert core.plan_step().duration == pytest.approx(0.020)  # no clock given: no slowdown
    # on the virtual clock: requests that start after the slowdown take four times as long
    t = simulate(cfg, [(0.0, "early", 10, 5), (2.0, "late", 10, 5)])
    assert t["late"].e2e == pytest.approx(4 * t["early"].e2e)


def test_slowdown_settings_are_checked():
    for bad in ({"slow_to": 0.0}, {"slow_to": 1.5}, {"slow_after": -1.0}):
        with pytest.raises(ValueError):
            SimConfig(**bad)
