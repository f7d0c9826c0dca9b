"""The state users see is derived from stored facts by one pure function: table-tested here."""

import pytest

from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import CrashPolicy, State, derive

NOW = 1_000.0
POLICY = CrashPolicy(max_failures=3, window=60.0)


def rec(**facts) -> ReplicaRecord:
    base = dict(id="r1", model="m", profile="p", node="a", nodes=["a"], created_at=NOW - 100)
    base.update(facts)
    return ReplicaRecord(**base)


CASES = [
    # (description, record facts, node alive, expected state, fragment of the reason)
    ("not placed", dict(node=None, nodes=[], pending_reason="no node has 2 free h100"), True,
     State.PENDING, "2 free h100"),
    ("placed, agent has not started it", dict(), True, State.LAUNCHING, "agent"),
    ("running, not healthy yet", dict(started_at=NOW - 5, pid=10), True, State.STARTING, ""),
    ("healthy", dict(started_at=NOW - 5, pid=10, first_ready_at=NOW - 2, last_probe_ok=True), True,
     State.READY, ""),
    ("was ready, probe failing", dict(started_at=NOW - 5, pid=10, first_ready_at=NOW - 2,
     last_probe_ok=False, probe_error="503 Loading"), True, State.UNHEALTHY, "503"),
    ("ready in an earlier attempt, restarted since", dict(started_at=NOW - 1, pid=11,
     first_ready_at=NOW - 50, last_probe_ok=True), True, State.STARTING, ""),
    ("exited", dict(started_at=NOW - 5, exited_at=NOW - 1, exit_code=1,
     failure_times=[NOW - 1]), True, State.FAILED, "code 1"),
    ("killed by a signal", dict(started_at=NOW - 5, exited_at=NOW - 1, exit_code=-9, exit_signal=9,
     failure_times=[NOW - 1]), True, State.FAILED, "signal 9"),
    ("too many failures in the window", dict(started_at=NOW - 5, exited_at=NOW - 1, exit_code=1,
     failure_times=[NOW - 30, NOW - 10, NOW - 1]), True, State.CRASHLOOP, "3 failures"),
    ("old failures fall out of the window", dict(started_at=NOW - 5, exited_at=NOW - 1, exit_code=1,
     failure_times=[NOW - 300, NOW - 200, NOW - 1]), True, State.FAILED, ""),
    ("running again after crash loop", dict(started_at=NOW - 0.5, exited_at=NOW - 1, pid=12,
     failure_times=[NOW - 30, NOW - 10, NOW - 1]), True, State.STARTING, ""),
    ("node heartbeat expired", dict(started_at=NOW - 5, pid=10, first_ready_at=NOW - 2,
     last_probe_ok=True), False, State.LOST, "heartbeats"),
    ("stop requested", dict(started_at=NOW - 5, pid=10, stop_requested_at=NOW - 1,
     stop_reason="surplus"), True, State.STOPPING, "surplus"),
    ("stop confirmed", dict(started_at=NOW - 5, stop_requested_at=NOW - 2, stopped_at=NOW - 1), True,
     State.STOPPED, ""),
    ("stop requested while pending", dict(node=None, nodes=[], stop_requested_at=NOW - 1), True,
     State.STOPPED, ""),
    ("stop requested, node gone", dict(started_at=NOW - 5, stop_requested_at=NOW - 1), False,
     State.LOST, "heartbeat"),
    # multi-node: Stopped only when every node's agent confirmed its own part
    ("multi-node stop, only the head confirmed", dict(nodes=["a", "b"], started_at=NOW - 5,
     stop_requested_at=NOW - 2, stopped_at=NOW - 1, stopped_nodes=["a"]), True, State.STOPPING, "b"),
    ("multi-node stop, only a member confirmed", dict(nodes=["a", "b"], started_at=NOW - 5,
     stop_requested_at=NOW - 2, stopped_nodes=["b"]), True, State.STOPPING, "a"),
    ("multi-node stop, every node confirmed", dict(nodes=["a", "b", "c"], started_at=NOW - 5,
     stop_requested_at=NOW - 2, stopped_at=NOW - 1, stopped_nodes=["a", "b", "c"]), True, State.STOPPED, ""),
    ("multi-node stop, unconfirmed member's node gone", dict(nodes=["a", "b"], started_at=NOW - 5,
     stop_requested_at=NOW - 2, stopped_at=NOW - 1, stopped_nodes=["a"]), False, State.LOST, "b"),
    ("single node: stopped_at alone still suffices", dict(started_at=NOW - 5, stop_requested_at=NOW - 2,
     stopped_at=NOW - 1, stopped_nodes=[]), True, State.STOPPED, ""),
]


@pytest.mark.parametrize("desc,facts,alive,state,reason", CASES, ids=[c[0] for c in CASES])
def test_derive(desc, facts, alive, state, reason):
    view = derive(rec(**facts), alive, NOW, POLICY)
    assert view.state is state
    assert reason in view.reason


def test_only_ready_is_routable():
    from llmgw.state.replica_state import is_routable

    routable = {s for _, f, alive, s, _ in CASES if is_routable(derive(rec(**f), alive, NOW, POLICY))}
    assert routable == {State.READY}


def test_stopped_nodes_are_loaded_from_per_node_fields_and_never_stored_under_that_name():
    from llmgw.state import keys

    stored = rec(nodes=["a", "b"]).to_dict()
    assert "stopped_nodes" not in stored
    stored[keys.replica_stopped_on("b")] = NOW
    stored[keys.replica_stopped_on("a")] = NOW
    assert ReplicaRecord.from_dict(stored).stopped_nodes == ["a", "b"]
