"""The agent's pure decision function: start, backoff, CrashLoop, stop, adopt, orphans, timeouts."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State, derive
from workers.agent import supervisor as sv

P = sv.Policy(backoff_base=1, backoff_cap=60, backoff_reset=120, stop_grace=10, liveness_timeout=30)


def rec(**kw) -> ReplicaRecord:
    base = dict(id="r1", model="m", profile="p", node="a", nodes=["a"])
    base.update(kw)
    return ReplicaRecord(**base)


def one(r: ReplicaRecord, obs: sv.Observed | None = None, now: float = 100.0, policy=P):
    return sv.decide([r], {r.id: obs} if obs else {}, [], now, policy)


def test_a_new_record_is_started():
    assert one(rec()) == [sv.Start("r1", 1, restart=False)]


def test_a_running_known_attempt_needs_nothing():
    r = rec(attempt=1, started_at=90, pid=5, first_ready_at=91)
    assert one(r, sv.Observed(alive=True, known=True, pid=5, last_ok_at=99)) == []


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 4), (4, 8), (7, 60), (40, 60)])
def test_backoff_doubles_and_is_capped(n, expected):
    assert sv.backoff(n, P) == expected


def test_a_crash_is_recorded_with_backoff_1_2_4():
    r = rec(attempt=1, started_at=90, pid=5)
    exit = sv.ExitFacts(1, None, 100.0)
    [a] = one(r, sv.Observed(alive=False, exit=exit, known=True))
    assert isinstance(a, sv.RecordExit)
    assert a.failure_times == (100.0,) and a.next_restart_at == 101.0 and a.restarts == 1
    r2 = rec(attempt=2, started_at=101, pid=6, failure_times=[100.0], restarts=1)
    [b] = one(r2, sv.Observed(exit=sv.ExitFacts(1, None, 102.0)), now=102)
    assert b.next_restart_at == 104.0 and b.restarts == 2
    r3 = rec(attempt=3, started_at=104, failure_times=[100.0, 102.0], restarts=2)
    [c] = one(r3, sv.Observed(exit=sv.ExitFacts(1, None, 105.0)), now=105)
    assert c.next_restart_at == 109.0


def test_restart_waits_for_next_restart_at():
    r = rec(attempt=1, started_at=90, exited_at=100, exit_code=1, failure_times=[100.0], next_restart_at=101)
    assert one(r, now=100.5) == []
    assert one(r, now=101.0) == [sv.Start("r1", 2, restart=True)]


def test_unknown_exit_counts_as_a_failure():
    r = rec(attempt=1, started_at=90, pid=5)
    [a] = one(r, sv.Observed(alive=False, exit=None), now=100)
    assert a.exit == sv.ExitFacts(None, None, 100) and a.failure_times == (100,)


def test_repeated_crashes_become_crashloop_and_keep_retrying():
    """Drive decide and apply its facts by hand: after 4 failures derive() says CrashLoop, and the
    agent still schedules the next attempt."""
    r, now = rec(), 0.0
    for i in range(4):
        [start] = one(r, now=now)
        assert isinstance(start, sv.Start)
        r = dataclasses.replace(r, attempt=start.attempt, started_at=now, pid=10 + i)
        now += 0.5
        [ex] = one(r, sv.Observed(exit=sv.ExitFacts(1, None, now)), now=now)
        r = dataclasses.replace(r, exited_at=now, exit_code=1, failure_times=list(ex.failure_times),
                                next_restart_at=ex.next_restart_at, restarts=ex.restarts)
        now = ex.next_restart_at
    assert derive(r, True, r.exited_at).state is State.CRASHLOOP
    assert r.next_restart_at == r.exited_at + 8  # 1, 2, 4, 8
    assert one(r, now=r.next_restart_at) == [sv.Start("r1", 5, restart=True)]


def test_a_long_healthy_run_resets_the_streak():
    r = rec(attempt=5, started_at=1000, first_ready_at=1001, failure_times=[1, 2, 3, 4], restarts=4)
    [a] = one(r, sv.Observed(exit=sv.ExitFacts(1, None, 1200.0)), now=1200)
    assert a.failure_times == (1200.0,) and a.next_restart_at == 1201.0


def test_stop_requested_terms_then_kills_after_grace_then_marks_stopped():
    r = rec(attempt=1, started_at=90, pid=5, pid_start=77, stop_requested_at=99, stop_reason="scale down")
    [t] = one(r, sv.Observed(alive=True, known=True, pid=5, pid_start=77), now=100)
    assert t == sv.Signal("r1", 5, 77, signal.SIGTERM, "stop requested: scale down")
    assert one(r, sv.Observed(alive=True, known=True, pid=5, pid_start=77, term_sent_at=100), now=105) == []
    [k] = one(r, sv.Observed(alive=True, known=True, pid=5, pid_start=77, term_sent_at=100), now=110)
    assert k.sig == signal.SIGKILL
    exit = sv.ExitFacts(-9, 9, 110.5)
    assert one(r, sv.Observed(alive=False, exit=exit), now=111) == [sv.MarkStopped(
        "r1", exit, 111, fields={"stopped_at": 111, "exit_code": -9, "exit_signal": 9, "exited_at": 110.5}, tail="")]
    assert one(dataclasses.replace(r, stopped_at=111), now=112) == []


def test_stop_of_a_never_started_replica_is_immediate():
    r = rec(stop_requested_at=5)
    assert one(r, now=6) == [sv.MarkStopped("r1", None, 6, fields={"stopped_at": 6})]


def test_an_unknown_running_attempt_is_adopted_not_restarted():
    r = rec(attempt=3, started_at=50, pid=5, pid_start=77, first_ready_at=51)
    acts = one(r, sv.Observed(alive=True, known=False, pid=5, pid_start=77, engine_pid=6, last_ok_at=None), now=100)
    assert acts == [sv.Adopt("r1", 5, 77, 6, fields={"adopted_at": 100, "engine_pid": 6})]


def test_not_healthy_within_start_timeout_is_terminated():
    r = rec(attempt=1, started_at=0, pid=5)
    obs = sv.Observed(alive=True, known=True, pid=5, start_timeout=30)
    assert one(r, obs, now=29) == []
    [t] = one(r, obs, now=31)
    assert t.sig == signal.SIGTERM and "start timeout" in t.reason
    # its exit is then a failure carrying the reason
    [e] = one(r, sv.Observed(exit=sv.ExitFacts(-15, 15, 32), term_reason=t.reason), now=32)
    assert isinstance(e, sv.RecordExit) and "start timeout" in e.reason


def test_liveness_failure_after_ready_is_terminated():
    r = rec(attempt=1, started_at=0, first_ready_at=1, pid=5)
    assert one(r, sv.Observed(alive=True, known=True, pid=5, last_ok_at=80), now=100) == []
    [t] = one(r, sv.Observed(alive=True, known=True, pid=5, last_ok_at=60), now=100)
    assert t.sig == signal.SIGTERM and "health probe failing" in t.reason
    off = dataclasses.replace(P, liveness_timeout=0)
    assert one(r, sv.Observed(alive=True, known=True, pid=5, last_ok_at=0), now=100, policy=off) == []


def test_orphans_are_stopped():
    o = sv.Orphan("gone", 42, 7)
    assert sv.decide([], {}, [o], 100, P) == [sv.Signal("gone", 42, 7, signal.SIGTERM, "its replica record was deleted", True)]
    o2 = sv.Orphan("gone", 42, 7, term_sent_at=85)
    [k] = sv.decide([], {}, [o2], 100, P)
    assert k.sig == signal.SIGKILL and k.orphan


def test_one_bad_record_does_not_hide_the_others():
    good, other = rec(id="a1"), rec(id="b1", attempt=1, started_at=1, pid=3)
    acts = sv.decide([good, other], {"b1": sv.Observed(alive=True, known=True, pid=3, last_ok_at=99, start_timeout=1e9)}, [], 100, P)
    assert acts == [sv.Start("a1", 1, restart=False)]


def test_a_headless_part_has_no_start_timeout_or_liveness():
    r = rec(attempt=1, started_at=0, first_ready_at=0, pid=5)
    assert one(r, sv.Observed(alive=True, known=True, pid=5, has_health=False, start_timeout=1), now=1e6) == []


# --- probes: thresholds and first_ready_at are decided here, not in the loop ----------------------
READY = dict(attempt=1, started_at=90, pid=5, first_ready_at=91, last_probe_ok=True, last_probe_at=99)
PP = dataclasses.replace(P, probe_failures=3, probe_refresh=5)


@pytest.mark.parametrize("desc,facts,before,ok,error,now,failures,fields,ready", [
    ("first success of an attempt: ready", dict(attempt=1, started_at=90, pid=5), 0, True, None, 100, 0,
     dict(last_probe_at=100, last_probe_ok=True, probe_error=None, first_ready_at=100), True),
    ("not ready yet, failing: reported at once", dict(attempt=1, started_at=90, pid=5), 0, False, "refused",
     100, 1, dict(last_probe_at=100, last_probe_ok=False, probe_error="refused"), False),
    ("ready, 1st failure: held back", READY, 0, False, "timeout", 100, 1, {}, False),
    ("ready, 2nd failure: held back", READY, 1, False, "timeout", 100, 2, {}, False),
    ("ready, 3rd failure: unhealthy", READY, 2, False, "timeout", 100, 3,
     dict(last_probe_at=100, last_probe_ok=False, probe_error="timeout"), False),
    ("ready, unchanged success: not rewritten", READY, 0, True, None, 100, 0, {}, False),
    ("ready, unchanged success after probe_refresh: rewritten", READY, 0, True, None, 104.5, 0,
     dict(last_probe_at=104.5, last_probe_ok=True, probe_error=None), False),
    ("a success resets the failure count", READY, 2, True, None, 100, 0, {}, False),
])
def test_probed(desc, facts, before, ok, error, now, failures, fields, ready):
    out = sv.probed(rec(**facts), before, ok, error, now, PP)
    assert (out.probe_failures, out.fields, out.became_ready) == (failures, fields, ready)


# --- a launch that could not be built counts like a crash ------------------------------------------
@pytest.mark.parametrize("failure_times,restarts,expected_backoff", [([], 0, 1), ([95], 1, 2), ([90, 95], 2, 4)])
def test_launch_failed_shares_the_crash_streak_and_backoff(failure_times, restarts, expected_backoff):
    out = sv.launch_failed(rec(failure_times=failure_times, restarts=restarts), 3, 100.0, "no port", P)
    failures, next_at = tuple(failure_times) + (100.0,), 100.0 + expected_backoff
    assert out == sv.LaunchFailed("r1", 3, 100.0, failures, next_at, restarts + 1, "no port", fields=dict(
        attempt=3, started_at=100.0, exited_at=100.0, exit_code=None, exit_signal=None, failure_times=list(failures),
        next_restart_at=next_at, restarts=restarts + 1, log_tail="[llmgw-agent] no port"))


# --- multi-node member parts follow the head's attempt ---------------------------------------------
MEMBER_RUNNING = dict(attempt=1, started_at=90, pid=5, first_ready_at=90)


@pytest.mark.parametrize("desc,facts,obs,expected", [
    ("head not running yet: wait", dict(), sv.Observed(head_attempt=0), []),
    ("head running attempt 2: join it", dict(), sv.Observed(head_attempt=2),
     [sv.Start("r1", 1, restart=False, head_attempt=2)]),
    ("joined the current head attempt: nothing to do", MEMBER_RUNNING,
     sv.Observed(alive=True, known=True, pid=5, head_attempt=2, joined_attempt=2, has_health=False), []),
    ("head restarted: leave the old rendezvous", MEMBER_RUNNING,
     sv.Observed(alive=True, known=True, pid=5, head_attempt=3, joined_attempt=2, has_health=False),
     [sv.Signal("r1", 5, None, signal.SIGTERM, "its head restarted (attempt 3)")]),
    ("head's attempt ended: leave", MEMBER_RUNNING,
     sv.Observed(alive=True, known=True, pid=5, head_attempt=0, joined_attempt=2, has_health=False),
     [sv.Signal("r1", 5, None, signal.SIGTERM, "its head's attempt ended")]),
    ("stale part ended: rejoin, no failure", MEMBER_RUNNING,
     sv.Observed(exit=sv.ExitFacts(-15, 15, 99), head_attempt=3, joined_attempt=2, known=True),
     [sv.Rejoin("r1", sv.ExitFacts(-15, 15, 99),
                fields={"exit_code": -15, "exit_signal": 15, "exited_at": 99, "next_restart_at": None})]),
    ("part ended a moment ago, head still looks up: wait for the head's agent", MEMBER_RUNNING,
     sv.Observed(exit=sv.ExitFacts(1, None, 99), head_attempt=2, joined_attempt=2, known=True), []),
    ("part crashed under the same head attempt, head still up after the settle time: a failure",
     MEMBER_RUNNING,
     sv.Observed(exit=sv.ExitFacts(1, None, 95), head_attempt=2, joined_attempt=2, known=True),
     [sv.RecordExit("r1", sv.ExitFacts(1, None, 95), (95,), 96.0, 1, "", tail="", fields={
         "exit_code": 1, "exit_signal": None, "exited_at": 95, "failure_times": [95], "next_restart_at": 96.0,
         "restarts": 1})]),
])
def test_member_parts_follow_the_head(desc, facts, obs, expected):
    assert one(rec(node="h", nodes=["h", "a"], **facts), obs) == expected


# --- stop escalation: one rule for stop requests, timeouts, orphans and the agent's shutdown --------
@pytest.mark.parametrize("desc,pid,term_sent_at,now,expected", [
    ("nothing to signal without a pid", None, None, 100, []),
    ("first: SIGTERM", 5, None, 100, [sv.Signal("r1", 5, 77, signal.SIGTERM, "why")]),
    ("SIGTERM sent, grace not over: wait", 5, 95, 104.9, []),
    ("grace over: SIGKILL", 5, 95, 105, [sv.Signal("r1", 5, 77, signal.SIGKILL, "why (grace period over)")]),
    ("and again every pass until it is gone", 5, 95, 130,
     [sv.Signal("r1", 5, 77, signal.SIGKILL, "why (grace period over)")]),
])
def test_stop_signals(desc, pid, term_sent_at, now, expected):
    assert sv.stop_signals("r1", pid, 77, term_sent_at, now, P, "why") == expected


# --- the facts each action records --------------------------------------------------------------
def test_an_exit_stamped_before_its_start_reads_as_ended_and_the_reason_goes_into_the_log():
    r = rec(attempt=1, started_at=100.5, pid=5)  # the shim's clock is a little behind the agent's
    [a] = one(r, sv.Observed(exit=sv.ExitFacts(1, None, 100.0), term_reason="not healthy"), now=101)
    assert a.fields["exited_at"] == 100.5 and a.reason == "not healthy"
    assert a.tail == "\n[llmgw-agent] terminated: not healthy\n"


def test_a_known_attempt_records_its_engine_pid_once_the_shim_reports_it():
    r = rec(attempt=1, started_at=90, pid=5, first_ready_at=91)
    running = dict(alive=True, known=True, pid=5, last_ok_at=99)
    assert one(r, sv.Observed(**running, engine_pid=6)) == [sv.Learned("r1", fields={"engine_pid": 6})]
    assert one(dataclasses.replace(r, engine_pid=6), sv.Observed(**running, engine_pid=6)) == []
    member = rec(node="h", nodes=["h", "a"], **MEMBER_RUNNING)  # only the head writes agent fields
    assert one(member, sv.Observed(**running, engine_pid=6, head_attempt=2, joined_attempt=2, has_health=False)) == []


def test_an_adopted_attempt_whose_pid_never_reached_redis_records_it():
    r = rec(attempt=1, started_at=90, first_ready_at=91)
    [a] = one(r, sv.Observed(alive=True, pid=5, pid_start=77, engine_pid=6))
    assert a.fields == {"adopted_at": 100, "pid": 5, "pid_start": 77, "engine_pid": 6}


def test_each_node_confirms_its_own_part_of_a_multi_node_stop():
    r = rec(node="h", nodes=["h", "a"], stop_requested_at=99, attempt=1, started_at=90)
    [a] = sv.decide([r], {}, [], 100, P, node="a")
    assert a.confirm == {"stopped_on:a": 100} and a.fields == {"stopped_at": 100, "exited_at": 100}


@pytest.mark.parametrize("desc,facts,start,serves_http,extra", [
    ("a single-node replica", dict(), sv.Start("r1", 1, restart=False), True, {}),
    ("a headless part is ready while it runs", dict(), sv.Start("r1", 1, restart=False), False,
     {"first_ready_at": 100}),
    ("a multi-node head records its rendezvous port", dict(nodes=["a", "b"]), sv.Start("r1", 1, restart=False), True,
     {"master_port": 21001}),
    ("a member part remembers the head attempt it joins, and keeps the head's url",
     dict(node="h", nodes=["h", "a"], url="http://h:1"), sv.Start("r1", 1, restart=False, head_attempt=4), False,
     {"first_ready_at": 100, "joined_attempt": 4, "url": "http://h:1"}),
])
def test_starting_records_the_intent_before_the_spawn(desc, facts, start, serves_http, extra):
    r = rec(attempt=0, pid=9, exit_code=1, next_restart_at=99, last_probe_ok=False, **facts)
    master_port = 21001 if "master_port" in extra else None
    fields = sv.starting(r, start, 100, 21000, "http://a:21000", master_port, serves_http)
    assert fields == {"attempt": 1, "started_at": 100, "port": 21000, "url": "http://a:21000", "pid": None,
                      "pid_start": None, "engine_pid": None, "exit_code": None, "exit_signal": None,
                      "next_restart_at": None, "last_probe_ok": None, "probe_error": None, "adopted_at": None,
                      **extra}


def test_shutdown_records_the_exit_but_no_failure():
    r = rec(attempt=1, started_at=90, pid=5, next_restart_at=None)
    assert sv.shutdown_exit(r, sv.ExitFacts(-9, 9, 100.0), 101) == sv.Facts(
        fields={"exit_code": -9, "exit_signal": 9, "exited_at": 100.0, "next_restart_at": None}, tail="")
    assert sv.shutdown_exit(r, None, 101).fields == {"exit_code": None, "exit_signal": None, "exited_at": 101,
                                                     "next_restart_at": None}


# --- this agent's memory of an attempt ----------------------------------------------------------
@pytest.mark.parametrize("desc,before,action,after", [
    ("adopted: known, and healthy as of now", None, sv.Adopt("r1", 5, 77, None),
     sv.Attempt(known=True, last_ok_at=100)),
    ("a SIGTERM is remembered with its reason", sv.Attempt(attempt=1, known=True),
     sv.Signal("r1", 5, 77, signal.SIGTERM, "why"),
     sv.Attempt(attempt=1, known=True, term_sent_at=100, term_reason="why")),
    ("a SIGKILL changes nothing", sv.Attempt(attempt=1, term_sent_at=90),
     sv.Signal("r1", 5, 77, signal.SIGKILL, "why"), sv.Attempt(attempt=1, term_sent_at=90)),
    ("a failed probe counts", sv.Attempt(attempt=1, last_ok_at=90), sv.Probed("r1", False, 2),
     sv.Attempt(attempt=1, last_ok_at=90, last_probe_at=100, probe_failures=2)),
    ("a good probe resets", sv.Attempt(attempt=1, probe_failures=2), sv.Probed("r1", True, 0),
     sv.Attempt(attempt=1, last_ok_at=100, last_probe_at=100)),
    ("an ended attempt is forgotten", sv.Attempt(attempt=1, known=True),
     sv.RecordExit("r1", sv.ExitFacts(1, None, 99), (99,), 100, 1), None),
    ("so is a stopped one", sv.Attempt(attempt=1, known=True), sv.MarkStopped("r1", None, 100), None),
])
def test_remember(desc, before, action, after):
    assert sv.remember(before, action, 100) == after


# --- adoption of a member part: its facts are this agent's, from the state dir -------------------
MN = dict(id="mn", model="m", profile="p", node="h", nodes=["h", "a"], attempt=3, started_at=50, pid=1, port=9,
          first_ready_at=51, last_probe_ok=True)


@pytest.mark.parametrize("desc,record,facts,found,view_facts,remembered", [
    ("the head sees the record itself", dict(MN, node="a", nodes=["a", "h"]), {}, None,
     dict(attempt=3, started_at=50, pid=1, port=9), {}),
    ("a member sees its own facts, not the head's", MN, {"attempt": 1, "pid": 7, "joined_attempt": 3}, None,
     dict(attempt=1, pid=7, started_at=None, port=None, last_probe_ok=None),
     {"attempt": 1, "pid": 7, "joined_attempt": 3}),
    ("a part found running is adopted into the head's current attempt", MN, {},
     sv.Found("mn", 2, 8, 80, None, alive=True),
     dict(attempt=2, pid=8, pid_start=80, started_at=100, first_ready_at=100),
     {"attempt": 2, "pid": 8, "pid_start": 80, "started_at": 100, "first_ready_at": 100, "joined_attempt": 3}),
    ("a part found dead is not adopted", MN, {}, sv.Found("mn", 2, 8, 80, None, alive=False),
     dict(attempt=0, pid=None, started_at=None), {}),
    ("a part this node confirmed stopped before a restart stays stopped",
     dict(MN, stop_requested_at=90, stopped_nodes=["a"]), {}, None, dict(stopped_at=90), {"stopped_at": 90}),
])
def test_part_view(desc, record, facts, found, view_facts, remembered):
    view, kept = sv.part_view(ReplicaRecord(**record), facts, found, "a", 100)
    assert {k: getattr(view, k) for k in view_facts} == view_facts and kept == remembered
    assert (view.node, view.url) == (record["node"], record.get("url"))  # control fields stay the record's


# --- what is left of deleted replicas ------------------------------------------------------------
def found(rid, alive=True):
    return sv.Found(rid, 1, 40, 400, None, alive)


@pytest.mark.parametrize("desc,found_,ids,catalog,dirs,expected", [
    ("a live attempt without a record is an orphan (its SIGTERM remembered)", {"x": found("x")}, set(), True, {},
     sv.Leftovers(orphans=(sv.Orphan("x", 40, 400, term_sent_at=95),))),
    ("a live attempt with a record is not", {"r1": found("r1")}, {"r1"}, True, {}, sv.Leftovers()),
    ("a dead one is not", {"x": found("x", alive=False)}, set(), True, {}, sv.Leftovers()),
    ("no catalog at all: a wiped or wrong Redis, leave them alone", {"x": found("x"), "y": found("y")}, set(), False,
     {}, sv.Leftovers(left_alone=2)),
    ("files of a deleted replica go after the retention", {}, set(), True, {"old": 100 - 3601, "new": 100 - 60},
     sv.Leftovers(remove=("old",))),
    ("never while its attempt still runs or it has a record", {"x": found("x")}, {"r1"}, True,
     {"x": 0, "r1": 0}, sv.Leftovers(orphans=(sv.Orphan("x", 40, 400, term_sent_at=95),))),
])
def test_leftovers(desc, found_, ids, catalog, dirs, expected):
    assert sv.leftovers(found_, ids, {"x": 95}, catalog, dirs, 100, 3600) == expected


def test_with_no_catalog_the_attempts_this_node_heads_are_registered_again():
    saved = {
        # as started: attempt 1's intent, an exit and a readiness of the attempt before it
        "x": ReplicaRecord(id="x", model="m", profile="p", node="a", nodes=["a"], gpus={"a": [0]}, spec_hash="h",
                           attempt=1, started_at=50, port=9, url="http://a:9", exit_code=1, exited_at=40,
                           first_ready_at=30, restarts=1, failure_times=[40]),
        "y": ReplicaRecord(id="y", model="m", profile="p", node="b", nodes=["b", "a"]),  # a member part here
    }
    live = {"x": sv.Found("x", 1, 40, 400, 41, True), "y": found("y"), "z": found("z")}
    rest = sv.leftovers(live, set(), {}, False, {}, 100, 3600, saved, "a")
    assert rest.orphans == () and rest.left_alone == 2  # y follows its head's record; z has no copy
    [rec] = rest.restore
    assert (rec.id, rec.node, rec.gpus, rec.spec_hash, rec.url, rec.restarts) == ("x", "a", {"a": [0]}, "h",
                                                                                  "http://a:9", 1)
    assert (rec.attempt, rec.pid, rec.pid_start, rec.engine_pid) == (1, 40, 400, 41)
    assert rec.exit_code is None and rec.exited_at is None and rec.first_ready_at is None
    # With a catalog, a missing record means deleted: the engine is stopped, never registered again.
    assert sv.leftovers(live, set(), {}, True, {}, 100, 3600, saved, "a").restore == ()


# --- planned stops drain first (docs/lifecycle.md) -----------------------------------------------------
from llmgw.state.kicks import PUBLISH, RECONCILE  # noqa: E402
from llmgw.state.replica_state import DrainProgress  # noqa: E402

SERVING = dict(attempt=1, started_at=50, pid=5, first_ready_at=51, last_probe_ok=True, url="http://a:1",
               stop_requested_at=99, stop_reason="replaced: spec changed", drain_timeout=120)
ALIVE = dict(alive=True, known=True, pid=5)

DRAIN_CASES = [
    # (description, record facts, observed drain, expected action kinds)
    ("draining with requests in flight: nothing yet", dict(), DrainProgress(False, 2, "2 in flight"), []),
    ("drain over: record it, then SIGTERM", dict(), DrainProgress(True, 0, "drained"), ["Drained", "SIGTERM"]),
    ("drain timed out: the same", dict(), DrainProgress(True, 1, "drain timed out"), ["Drained", "SIGTERM"]),
    ("no drain asked (no progress given): SIGTERM at once", dict(), None, ["SIGTERM"]),
    ("already drained (e.g. a restarted agent): SIGTERM only", dict(drained_at=99.5), DrainProgress(True, 0, "drained"),
     ["SIGTERM"]),
]


@pytest.mark.parametrize("desc,facts,drain,kinds", DRAIN_CASES, ids=[c[0] for c in DRAIN_CASES])
def test_a_planned_stop_waits_for_its_drain(desc, facts, drain, kinds):
    actions = one(rec(**{**SERVING, **facts}), sv.Observed(**ALIVE, drain=drain))
    got = [signal.Signals(a.sig).name if isinstance(a, sv.Signal) else type(a).__name__ for a in actions]
    assert got == kinds
    drained = [a for a in actions if isinstance(a, sv.Drained)]
    if drained:
        assert drained[0].fields == {"drained_at": 100.0, "drain_note": drain.note}


def test_once_terminating_the_escalation_goes_on_whatever_the_drain_says():
    obs = sv.Observed(**ALIVE, term_sent_at=85.0, drain=DrainProgress(False, 3, "3 in flight"))
    [kill] = one(rec(**SERVING, drained_at=85.0), obs, now=100.0)
    assert kill.sig == signal.SIGKILL


def test_a_member_part_waits_for_its_heads_drain_and_records_nothing():
    member = rec(**SERVING, nodes=["a", "b"])  # this node is b; the head a drains and records drained_at
    waiting = sv.decide([member], {"r1": sv.Observed(**ALIVE, head_attempt=1, joined_attempt=1,
                                                     drain=DrainProgress(False, note="waiting for the head"))},
                        [], 100.0, P, node="b")
    assert waiting == []
    done = sv.decide([member], {"r1": sv.Observed(**ALIVE, head_attempt=1, joined_attempt=1,
                                                  drain=DrainProgress(True, note="the head drained"))},
                     [], 100.0, P, node="b")
    assert [type(a).__name__ for a in done] == ["Signal"]


NEWS_CASES = [
    ("became ready", sv.Probed("r1", True, 0, True, fields={"first_ready_at": 100}), ["replica_ready"], {PUBLISH}),
    ("turned unhealthy", sv.Probed("r1", False, 3, fields={"last_probe_ok": False, "probe_error": "503"}),
     ["replica_unhealthy"], {PUBLISH}),
    ("crashed", sv.RecordExit("r1", sv.ExitFacts(-4, 4, 100.0), (100.0,), 101.0, 1), ["replica_failed"],
     {PUBLISH, RECONCILE}),
    ("crashed a fourth time in the window", sv.RecordExit("r1", sv.ExitFacts(1, None, 100.0), (40.0, 60.0, 80.0, 100.0),
                                                          160.0, 4), ["replica_failed", "replica_crashloop"],
     {PUBLISH, RECONCILE}),
    ("restarted", sv.Start("r1", 2, restart=True), ["replica_restarted"], set()),
    ("stopped", sv.MarkStopped("r1", None, 100.0), ["replica_stopped"], {RECONCILE}),
    ("an unchanged probe says nothing", sv.Probed("r1", True, 0), [], set()),
]


@pytest.mark.parametrize("desc,action,kinds,kicks", NEWS_CASES, ids=[c[0] for c in NEWS_CASES])
def test_news_of_an_action(desc, action, kinds, kicks):
    r = rec(attempt=1, started_at=50, first_ready_at=51, last_probe_ok=True, url="http://a:1")
    out = sv.news(r, action)
    assert [n.kind for n in out] == kinds
    assert {k for n in out for k in n.kicks} == kicks


def test_a_crash_by_signal_is_named():
    [n] = sv.news(rec(attempt=3), sv.RecordExit("r1", sv.ExitFacts(-4, 4, 100.0), (100.0,), 101.0, 1))
    assert "SIGILL" in n.message and "attempt 3" in n.message


# --- which probes are due this pass ----------------------------------------------------------------
PROBING = sv.Policy(probe_interval=1.0, start_probe_interval=0.1)
STARTING = dict(attempt=1, started_at=90, pid=5, url="http://a:1/")
SERVING_READY = dict(STARTING, first_ready_at=91, last_probe_ok=True)
RUNNING = sv.Observed(alive=True, known=True, pid=5)

DUE_CASES = [
    # (description, record facts, observed, memory (None: none), health path, expected probe urls)
    ("never probed: due", STARTING, RUNNING, sv.Attempt(attempt=1), None, ["http://a:1/health"]),
    ("starting, probed 0.05 s ago: not yet", STARTING, RUNNING, sv.Attempt(attempt=1, last_probe_at=99.95), None, []),
    ("starting, probed 0.2 s ago: due", STARTING, RUNNING, sv.Attempt(attempt=1, last_probe_at=99.8), None,
     ["http://a:1/health"]),
    ("ready, probed 0.5 s ago: not yet", SERVING_READY, RUNNING, sv.Attempt(attempt=1, last_probe_at=99.5), None, []),
    ("ready, probed 1 s ago: due, at the engine's health path", SERVING_READY, RUNNING,
     sv.Attempt(attempt=1, last_probe_at=99.0), "/v1/health", ["http://a:1/v1/health"]),
    ("not running", STARTING, sv.Observed(alive=False), sv.Attempt(attempt=1), None, []),
    ("a headless part has no /health", STARTING, dataclasses.replace(RUNNING, has_health=False),
     sv.Attempt(attempt=1), None, []),
    ("no memory of the attempt (not observed this pass)", STARTING, RUNNING, None, None, []),
    ("asked to stop: no more probes", dict(STARTING, stop_requested_at=99), RUNNING, sv.Attempt(attempt=1), None, []),
    ("no url yet", dict(STARTING, url=None), RUNNING, sv.Attempt(attempt=1), None, []),
]


@pytest.mark.parametrize("desc,facts,obs,memory,path,urls", DUE_CASES, ids=[c[0] for c in DUE_CASES])
def test_due_probes(desc, facts, obs, memory, path, urls):
    r = rec(**facts)
    due = sv.due_probes([r], {r.id: obs}, {r.id: memory} if memory else {}, {r.id: path} if path else {}, 100.0,
                        PROBING)
    assert [p.url for p in due] == urls


def test_a_due_probe_carries_the_failures_in_a_row_before_it():
    r = rec(**SERVING_READY)
    [p] = sv.due_probes([r], {r.id: RUNNING}, {r.id: sv.Attempt(attempt=1, last_probe_at=90, probe_failures=2)},
                        {}, 100.0, PROBING)
    assert p == sv.Probe("r1", "http://a:1/health", failures=2)


# --- one write per record per pass ---------------------------------------------------------------
HEAD = rec(attempt=1)
MEMBER = rec(id="mn", node="b", nodes=["b", "a"], attempt=1)

MERGE_CASES = [
    # (description, [(record, facts)], tails, expected record writes, expected member memory)
    ("nothing to record", [], {}, {}, {}),
    ("a probe and a learned pid: one write with both",
     [(HEAD, sv.Facts(fields={"last_probe_ok": True})), (HEAD, sv.Facts(fields={"engine_pid": 6}))], {},
     {"r1": {"last_probe_ok": True, "engine_pid": 6}}, {}),
    ("a later value of a field wins",
     [(HEAD, sv.Facts(fields={"exited_at": 1.0, "exit_code": 1})), (HEAD, sv.Facts(fields={"exited_at": 2.0}))], {},
     {"r1": {"exited_at": 2.0, "exit_code": 1}}, {}),
    ("an exit records the end of the engine log and the note",
     [(HEAD, sv.Facts(fields={"exit_code": 1}, tail="\nnote"))], {"r1": "log"},
     {"r1": {"exit_code": 1, "log_tail": "log\nnote"}}, {}),
    ("the log's end is cut to LOG_TAIL_BYTES", [(HEAD, sv.Facts(tail="!"))], {"r1": "x" * sv.LOG_TAIL_BYTES},
     {"r1": {"log_tail": "x" * (sv.LOG_TAIL_BYTES - 1) + "!"}}, {}),
    ("no tail asked: log_tail left alone", [(HEAD, sv.Facts(fields={"pid": 5}))], {"r1": "log"},
     {"r1": {"pid": 5}}, {}),
    ("a member part's facts go to this agent's memory, its confirmation to the record",
     [(MEMBER, sv.Facts(fields={"stopped_at": 100}, confirm={"stopped_on:a": 100}))], {},
     {"mn": {"stopped_on:a": 100}}, {"mn": {"stopped_at": 100}}),
    ("a head's and a member's facts in one pass",
     [(HEAD, sv.Facts(fields={"pid": 5})), (MEMBER, sv.Facts(fields={"pid": 7, "joined_attempt": 1}))], {},
     {"r1": {"pid": 5}}, {"mn": {"pid": 7, "joined_attempt": 1}}),
]


@pytest.mark.parametrize("desc,facts,tails,records,members", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_merge_writes_each_record_once(desc, facts, tails, records, members):
    writes = sv.merge(facts, "a", tails)
    assert {k: v for k, v in writes.records.items() if v} == records
    assert {k: v for k, v in writes.members.items() if v} == members


def test_with_fields_is_the_record_as_the_write_leaves_it():
    after = sv.with_fields(HEAD, {"pid": 5, "joined_attempt": 3})  # joined_attempt: a member's memory only
    assert (after.pid, after.attempt) == (5, 1)
