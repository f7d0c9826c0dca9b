"""`desired()` over load histories with a fake clock: up quickly by what the load needs, down slowly one
step at a time, never outside [min, max], no flapping on a noisy signal, idle to zero, cold start from
zero; `observe()` reading the gateways' reports and the engines' scrapes; `decide_all()`."""

from __future__ import annotations

import pytest

from llmgw.catalog import parse_catalog
from llmgw.state.demand_records import DemandHint, EndpointUse, GatewayReport, ModelDemand, ScaleState
from llmgw.state.records import LoadRecord
from tests.unit.control_support import ready_record
from workers.control.autoscale import Decision, Sample, ScaleSpec, decide_all, desired, observe

SPEC = ScaleSpec(min=1, max=4, target=0.7, capacity=10, scale_up_after=5, scale_down_after=60)
ZERO = ScaleSpec(min=0, max=4, target=0.7, capacity=10, scale_up_after=5, scale_down_after=60, idle_after=300)


def drive(spec: ScaleSpec, demand, t_end: float, count: int = 1, step: float = 2.0, active=None):
    """Play the control loop: a sample every `step` seconds of `demand(t)` (requests), a decision
    after each, the count taken at once. Returns the changes as (t, count, reason)."""
    history: list[Sample] = []
    since = 0.0
    changes = []
    t = 0.0
    last_active = 0.0
    while t <= t_end:
        d = demand(t)
        if d > 0:
            last_active = t
        history.append(Sample(t, inflight=d, last_active=active if active is not None else last_active))
        history = [s for s in history if s.t >= t - spec.horizon]
        dec = desired(spec, history, count, t, since)
        assert spec.min <= dec.count <= spec.max, dec
        if dec.changed:
            changes.append((t, dec.count, dec.reason))
            count, since = dec.count, t
        t += step
    return changes


def test_a_step_load_scales_up_quickly_by_what_it_needs():
    # 25 requests at capacity 10 and target 0.7 need ceil(25 / 7) = 4 replicas: one step, not four.
    changes = drive(SPEC, lambda t: 25 if t >= 10 else 2, 40)
    assert changes == [(16.0, 4, "1 -> 4: load 2.50 per replica for 6 s, target 0.7")]


def test_the_explanation_names_the_load_the_duration_and_the_target():
    history = [Sample(t, inflight=27.6) for t in (0, 2, 4, 6)]
    assert desired(SPEC, history, 3, 6.0, since=-100) == \
        Decision(4, "3 -> 4: load 0.92 per replica for 6 s, target 0.7", 3)


def test_down_slowly_one_step_at_a_time_never_below_min():
    changes = drive(SPEC, lambda t: 25 if t < 20 else 0, 400, count=4)
    assert [(t, n) for t, n, _ in changes] == [(80.0, 3), (140.0, 2), (200.0, 1)]
    assert changes[0][2] == "4 -> 3: load 0.00 per replica for 60 s; 3 carry it at 0.00, target 0.7"


def test_a_short_dip_does_not_scale_down():
    changes = drive(SPEC, lambda t: 0 if 50 <= t < 90 else 20, 200, count=3)
    assert changes == []


def test_never_above_max():
    changes = drive(SPEC, lambda t: 500, 60)
    assert [n for _, n, _ in changes] == [4]


@pytest.mark.parametrize("current,spec,expected", [
    (6, SPEC, Decision(4, "6 -> 4: max is 4", 6)),
    (0, ScaleSpec(2, 5, 0.7, 10, 5, 60), Decision(2, "0 -> 2: min is 2", 0)),
])
def test_a_count_outside_the_bounds_moves_inside_at_once(current, spec, expected):
    assert desired(spec, [Sample(0, inflight=0)], current, 0) == expected


def test_noise_inside_the_band_changes_nothing():
    # Alternating 4 and 9 requests on one replica (load 0.4 / 0.9): never above target for 5 s.
    assert drive(SPEC, lambda t: 9 if int(t / 2) % 2 else 4, 300) == []
    # 12 requests on 2 replicas: load 0.6 is below target, and 1 replica would be at 1.2: stays.
    assert drive(SPEC, lambda t: 12, 300, count=2) == []


def test_the_band_after_a_change_does_not_flap():
    # Just above target on 2 replicas: up to the count that carries it, then no way back down while
    # the load holds (one fewer would be above target again).
    changes = drive(SPEC, lambda t: 15, 600, count=2)
    assert [(n) for _, n, _ in changes] == [3]


def test_the_windows_restart_at_every_change():
    hist = [Sample(t, inflight=25) for t in range(0, 11)]
    assert not desired(SPEC, hist, 2, 10.0, since=8.0).changed  # above target only 2 s at this count
    assert desired(SPEC, hist, 2, 10.0, since=4.0).count == 4


def test_idle_goes_to_zero_only_with_min_zero():
    changes = drive(ZERO, lambda t: 0, 400, count=2)
    assert [(t, n) for t, n, _ in changes] == [(60.0, 1), (300.0, 0)]
    assert changes[-1][2] == "1 -> 0: no request for 300 s (idle_after 300 s)"
    assert [n for _, n, _ in drive(SPEC, lambda t: 0, 400, count=1)] == []


def test_a_recent_answer_keeps_a_profile_from_idling():
    # No request in flight at any sample, but the gateways answered one at t=250.
    history = [Sample(t, last_active=250.0) for t in range(0, 400, 2)]
    assert desired(ZERO, history, 1, 398.0, since=0.0).count == 1
    assert desired(ZERO, history, 1, 550.0, since=0.0).count == 0


@pytest.mark.parametrize("queued,expected", [
    (1, Decision(1, "0 -> 1: 1 request waiting (cold start)", 0)),
    (12, Decision(2, "0 -> 2: 12 requests waiting (cold start)", 0)),
    (300, Decision(4, "0 -> 4: 300 requests waiting (cold start)", 0)),
    (0, Decision(0, "holds 0: idle", 0)),
])
def test_a_cold_start_is_immediate(queued, expected):
    assert desired(ZERO, [Sample(100.0, queued=queued)], 0, 100.0, since=0.0) == expected


def test_holding_says_why():
    assert desired(SPEC, [Sample(0, inflight=11)], 2, 0).reason == "holds 2: load 0.55 per replica, target 0.7"
    assert desired(SPEC, [], 2, 0).reason == "holds 2: no load figures yet"


# --- observe ----------------------------------------------------------------------------------------
def report(gid, endpoints=None, models=None):
    return GatewayReport(id=gid, at=0.0, endpoints=endpoints or {}, models=models or {})


def test_observe_sums_the_gateways_and_takes_the_larger_of_gateways_and_engines():
    reports = [report("g1", {"r1": EndpointUse(3, ok_at=90.0), "other": EndpointUse(9)},
                      {"m": ModelDemand(3, 2, 95.0)}),
               report("g2", {"r2": EndpointUse(1)}, {"alias": ModelDemand(1, 1, 96.0)})]
    loads = {"r1": LoadRecord("r1", ts=99.0, ok=True, running=6, waiting=2),
             "r2": LoadRecord("r2", ts=80.0, ok=True, running=50)}  # stale: ignored
    s = observe(100.0, ["m", "alias"], ["r1", "r2"], reports, loads)
    assert (s.inflight, s.engine, s.queued, s.demand, s.last_active) == (4, 8, 3, 11, 100.0)
    idle = observe(100.0, ["m"], ["r1"], [report("g", {"r1": EndpointUse(0, ok_at=90.0)})], {}, last_active=50.0)
    assert (idle.demand, idle.engine, idle.last_active) == (0, None, 90.0)


def test_a_cold_start_hint_counts_until_the_reports_take_over():
    assert observe(100.0, ["m"], [], [], {}, DemandHint(at=95.0, queued=2)).queued == 2
    assert observe(100.0, ["m"], [], [], {}, DemandHint(at=50.0, queued=2)).queued == 0


# --- decide_all -------------------------------------------------------------------------------------
CAT = parse_catalog({"models": [{"name": "m", "profiles": [
    {"name": "auto", "engine": "sim", "capacity": 10, "autoscale": {"min": 0, "max": 4, "scale_up_after": 1}},
    {"name": "fixed", "engine": "sim", "replicas": 2},
]}]})


def test_a_profile_starts_autoscaling_from_the_replicas_it_has():
    recs = [ready_record(f"r{i}", "m", "auto", "a", 100.0) for i in range(3)]
    out = decide_all(CAT, recs, {}, {}, [], {}, {}, 100.0)
    assert out.counts == {("m", "auto"): 3}  # the fixed profile is not the autoscaler's
    (p,) = out.profiles
    assert p.state.count == 3 and p.state.last_active == 100.0 and not p.decision.changed


def test_decide_all_records_a_change_and_the_loads_of_replicas():
    recs = [ready_record("r1", "m", "auto", "a", 100.0)]
    state = ScaleState(count=1, since=50.0, reason="0 -> 1: 1 request waiting (cold start)", previous=0)
    history = {("m", "auto"): [Sample(t, inflight=20) for t in (97.0, 98.0)]}
    reports = [report("g", {"r1": EndpointUse(20)})]
    out = decide_all(CAT, recs, {("m", "auto"): state}, history, reports, {}, {}, 99.0)
    (p,) = out.profiles
    assert p.decision == Decision(3, "1 -> 3: load 2.00 per replica for 2 s, target 0.7", 1)
    assert (p.state.count, p.state.since, p.state.previous, p.state.reason) == (3, 99.0, 1, p.decision.reason)
    assert out.replica_load == {"r1": 20.0}
    # Held: the state keeps its last change, and notes this pass's reason.
    calm = decide_all(CAT, recs, {("m", "auto"): state}, {}, [report("g", {"r1": EndpointUse(5)})], {}, {}, 99.0)
    (q,) = calm.profiles
    assert (q.state.count, q.state.since, q.state.reason) == (1, 50.0, state.reason)
    assert q.state.note == "holds 1: load 0.50 per replica, target 0.7"


def test_a_pending_scale_up_says_when_its_window_ends():
    history = [Sample(t, inflight=25) for t in (10.0, 12.0)]
    d = desired(SPEC, history, 1, 12.0, since=0.0)
    assert not d.changed and d.recheck_at == 15.0  # above target since 10, scale_up_after 5
    assert desired(SPEC, [Sample(10.0, inflight=2)], 1, 10.0).recheck_at is None
    assert desired(SPEC, history, 4, 12.0).recheck_at is None  # at max: nothing to wait for
