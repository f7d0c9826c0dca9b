"""The replica lifecycle's pure decisions (docs/lifecycle.md), table-tested: the drain of a planned
stop, the publish decision for a replica whose node agent is gone, and the kick coalescing rule."""

from __future__ import annotations

import pytest

from llmgw.state.kicks import SCHEDULED_TTL, KickRule, KickState
from llmgw.state.demand_records import EndpointUse, GatewayReport, ModelDemand
from llmgw.state.records import LoadRecord, ReplicaRecord
from llmgw.state.replica_state import State, derive, drain_progress
from workers.control.publish import Evidence, merge_evidence, routable

NOW = 1_000.0


def rec(**facts) -> ReplicaRecord:
    base = dict(id="r1", model="m", profile="p", node="a", nodes=["a"], created_at=NOW - 100, url="http://a:1",
                started_at=NOW - 50, pid=10, first_ready_at=NOW - 40, last_probe_ok=True)
    base.update(facts)
    return ReplicaRecord(**base)


def stopping(**facts) -> ReplicaRecord:
    base = dict(stop_requested_at=NOW - 2, stop_reason="replaced: spec changed", drain_timeout=120.0,
                unpublished_version=7)
    base.update(facts)
    return rec(**base)


def gw(version: int, inflight: int = 0, gid: str = "g1") -> GatewayReport:
    eps = {"r1": EndpointUse(inflight=inflight)} if inflight else {}
    return GatewayReport(id=gid, at=NOW, version=version, endpoints=eps)


def load(running: float | None = 0, waiting: float | None = 0, ts: float = NOW - 0.5, ok: bool = True) -> LoadRecord:
    return LoadRecord(replica_id="r1", ts=ts, ok=ok, running=running, waiting=waiting)


DRAIN_CASES = [
    # (description, record, gateway reports, engine load, done, fragment of the note)
    ("not published away yet", stopping(unpublished_version=None), [gw(6)], load(), False, "publisher"),
    ("a gateway still routes by the old list", stopping(), [gw(7), gw(6, gid="g2")], load(), False, "1 gateway"),
    ("gateways moved on, requests still in flight there", stopping(), [gw(7, inflight=2)], load(2), False,
     "2 in flight"),
    ("gateways idle, the engine still running one", stopping(), [gw(8)], load(running=1), False, "1 in flight"),
    ("the engine's queue counts too", stopping(), [gw(8)], load(running=0, waiting=3), False, "3 in flight"),
    ("all quiet: drained", stopping(), [gw(7), gw(9, gid="g2")], load(), True, "drained"),
    ("no gateway at all and an idle engine", stopping(), [], load(), True, "drained"),
    ("a stale scrape says nothing", stopping(), [gw(7)], load(running=4, ts=NOW - 60), True, "drained"),
    ("a failed scrape says nothing", stopping(), [gw(7)], load(running=4, ok=False), True, "drained"),
    ("unknown engine counts are not counted", stopping(), [gw(7)], load(running=None, waiting=None), True,
     "drained"),
    ("timed out with requests left", stopping(stop_requested_at=NOW - 121), [gw(7, inflight=1)], load(1), True,
     "timed out"),
    ("timed out before the publisher even ran", stopping(stop_requested_at=NOW - 121, unpublished_version=None),
     [], None, True, "timed out"),
    ("never served this attempt: nothing to drain", stopping(first_ready_at=None), [gw(1, inflight=3)], None,
     True, "nothing to drain"),
    ("ready in an earlier attempt only", stopping(first_ready_at=NOW - 60), [gw(1)], None, True, "nothing"),
    ("a profile with drain_timeout 0", stopping(drain_timeout=0.0), [gw(1, inflight=3)], load(3), True,
     "nothing to drain"),
    ("the agent already decided", stopping(drained_at=NOW - 1, drain_note="drained"), [gw(1, inflight=3)],
     load(3), True, "drained"),
]


@pytest.mark.parametrize("desc,record,gateways,engine,done,note", DRAIN_CASES, ids=[c[0] for c in DRAIN_CASES])
def test_drain_progress(desc, record, gateways, engine, done, note):
    p = drain_progress(record, gateways, engine, NOW)
    assert p.done is done
    assert note in p.note


def test_in_flight_is_the_larger_of_the_gateways_and_the_engine_view():
    p = drain_progress(stopping(), [gw(7, inflight=2), gw(7, inflight=1, gid="g2")], load(running=1), NOW)
    assert (p.done, p.inflight) == (False, 3)


DERIVE_CASES = [
    ("stop requested on a serving replica: draining", stopping(), State.DRAINING),
    ("drained: terminating", stopping(drained_at=NOW - 1), State.STOPPING),
    ("stop requested, never ready: straight to stopping", stopping(first_ready_at=None), State.STOPPING),
    ("no drain asked", stopping(drain_timeout=0.0), State.STOPPING),
    ("gone after the drain", stopping(drained_at=NOW - 1, stopped_at=NOW), State.STOPPED),
]


@pytest.mark.parametrize("desc,record,state", DERIVE_CASES, ids=[c[0] for c in DERIVE_CASES])
def test_derive_tells_draining_from_stopping(desc, record, state):
    assert derive(record, True, NOW).state is state


ROUTE_CASES = [
    # (description, record, node alive, lost since, evidence, routable, fragment of why)
    ("ready on a live node", rec(), True, NOW, None, True, "Ready"),
    ("starting on a live node", rec(first_ready_at=None), True, NOW, None, False, "Starting"),
    ("asked to stop", rec(stop_requested_at=NOW - 1), True, NOW, None, False, "stop"),
    ("no url yet", rec(url=None), True, NOW, None, False, "URL"),
    ("agent lost, was ready, no evidence", rec(), False, NOW - 20, None, True, "lost 20s ago"),
    ("agent lost, gateways keep succeeding", rec(), False, NOW - 20, Evidence(ok_at=NOW - 1, fail_at=NOW - 10),
     True, "lost"),
    ("agent lost, the latest word is a failure", rec(), False, NOW - 20, Evidence(ok_at=NOW - 10, fail_at=NOW - 1),
     False, "fail to reach"),
    ("agent lost, failures only", rec(), False, NOW - 5, Evidence(fail_at=NOW - 1), False, "fail"),
    ("agent lost longer than the grace", rec(), False, NOW - 301, None, False, "grace"),
    ("agent lost while it was starting", rec(first_ready_at=None), False, NOW - 5, None, False, "not Ready"),
    ("agent lost while unhealthy", rec(last_probe_ok=False), False, NOW - 5, None, False, "not Ready"),
    ("agent lost after the engine exited", rec(exited_at=NOW - 30), False, NOW - 5, None, False, "not Ready"),
    ("agent lost, stop requested", rec(stop_requested_at=NOW - 1), False, NOW - 5, None, False, "stop"),
]


@pytest.mark.parametrize("desc,record,alive,lost_at,evidence,ok,why", ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES])
def test_routable(desc, record, alive, lost_at, evidence, ok, why):
    got, reason = routable(record, alive, lost_at, evidence, NOW, lost_grace=300.0)
    assert got is ok
    assert why in reason


def test_evidence_merges_the_latest_success_and_failure_over_gateways():
    reports = [
        GatewayReport(id="g1", at=NOW, endpoints={"r1": EndpointUse(ok_at=NOW - 9, fail_at=NOW - 3)}),
        GatewayReport(id="g2", at=NOW, endpoints={"r1": EndpointUse(ok_at=NOW - 1), "r2": EndpointUse(fail_at=NOW)}),
    ]
    ev = merge_evidence(reports)
    assert ev["r1"] == Evidence(ok_at=NOW - 1, fail_at=NOW - 3) and not ev["r1"].failing
    assert ev["r2"].failing


def test_gateway_report_round_trips_compactly():
    g = GatewayReport(id="h:1", at=NOW, version=4, host="h", pid=1, keys_loaded=True,
                      endpoints={"r1": EndpointUse(2, NOW - 1, None)},
                      models={"m": ModelDemand(inflight=2, queued=1, last_request_at=NOW)})
    d = g.to_dict()
    assert d["endpoints"] == {"r1": [2, NOW - 1, None]}
    assert GatewayReport.from_dict(d) == g


# --- the kick coalescing rule, on a fake clock ------------------------------------------------------
def run_burst(kick_times: list[float], pass_time: float, debounce: float) -> list[tuple[float, float]]:
    """Simulate kicks at `kick_times` against one control worker whose passes take `pass_time`:
    a sent task runs `debounce` later (or once the previous pass ended). Returns the passes."""
    state = KickState()
    queue: list[float] = []  # when sent tasks become due
    passes: list[tuple[float, float]] = []
    busy_until = float("-inf")
    events = sorted((t, "kick") for t in kick_times)
    i = 0
    while i < len(events) or queue:
        next_kick = events[i][0] if i < len(events) else float("inf")
        next_task = max(queue[0], busy_until) if queue else float("inf")
        if next_kick <= next_task:
            state, send = KickRule.kick(state, next_kick)
            if send:
                queue.append(next_kick + debounce)
            i += 1
            continue
        start = queue.pop(0)
        start = max(start, busy_until)
        state = KickRule.started(state, start)
        end = start + pass_time
        # kicks during the pass
        while i < len(events) and events[i][0] < end:
            state, send = KickRule.kick(state, events[i][0])
            if send:
                queue.append(events[i][0] + debounce)
            i += 1
        state, again = KickRule.finished(state, end)
        if again:
            queue.append(end + debounce)
        passes.append((start, end))
        busy_until = end
    return passes


def test_a_burst_of_a_hundred_facts_makes_a_handful_of_passes():
    kicks = [i * 0.001 for i in range(100)]  # 100 state changes within 100 ms
    passes = run_burst(kicks, pass_time=0.02, debounce=0.03)
    assert 1 <= len(passes) <= 10
    # every fact is seen by a pass that started after it
    assert passes[-1][0] >= kicks[-1]


def test_a_fact_during_a_pass_gets_a_pass_of_its_own():
    passes = run_burst([0.0, 0.04], pass_time=0.02, debounce=0.03)
    assert len(passes) == 2 and passes[1][0] >= 0.04


def test_a_scheduled_mark_outlives_a_lost_task_by_its_ttl_only():
    state, sent = KickRule.kick(KickState(), 0.0)
    assert sent
    state, sent = KickRule.kick(state, SCHEDULED_TTL / 2)
    assert not sent and state.dirty
    _state, sent = KickRule.kick(state, SCHEDULED_TTL + 0.01)
    assert sent


def test_the_kicker_sends_one_task_per_burst_and_again_for_facts_during_a_pass():
    import fakeredis

    from llmgw.state.store import Store

    from llmgw.state.kicks import PUBLISH, RECONCILE, Kicker

    r = fakeredis.FakeRedis(decode_responses=True)
    sent: list[str] = []
    k = Kicker(Store(r), lambda task, countdown: sent.append(task))
    for _ in range(50):
        k.kick(RECONCILE)
    k.kick(PUBLISH)
    assert sent == [RECONCILE, PUBLISH]
    k.started(RECONCILE)  # the pass begins: later facts need another pass
    assert not k.finished(RECONCILE) and sent == [RECONCILE, PUBLISH]
    k.started(RECONCILE)
    k.kick(RECONCILE)  # a fact while the pass runs
    assert sent == [RECONCILE, PUBLISH, RECONCILE]
    k.mark_dirty(RECONCILE)
    r.delete("llmgw:kick:llmgw.reconcile")  # that task already started elsewhere and found the lock taken
    assert k.finished(RECONCILE)
    assert sent[-1] == RECONCILE


def test_a_kicker_that_cannot_reach_redis_never_raises():
    import redis as redis_lib

    from llmgw.state.store import Store

    from llmgw.state.kicks import RECONCILE, Kicker

    dead = redis_lib.Redis(port=1, socket_connect_timeout=0.05)
    k = Kicker(Store(dead), lambda task, countdown: None)
    assert k.kick(RECONCILE) is False
    k.started(RECONCILE)
    assert k.finished(RECONCILE) is False
