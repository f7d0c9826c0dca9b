"""The state users see is derived from stored facts by one pure function: table-tested here."""

import pytest

from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import CrashPolicy, State, derive

NOW = 1_000.0
POLICY = CrashPolicy(max_failures=3, window=60.0)
HF = "hf://org/smol-gguf/*Q4_1.gguf"


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
     failure_times=[NOW - 1]), True, State.FAILED, "killed by SIGKILL (often out of memory"),
    ("killed by SIGILL, with its log", dict(started_at=NOW - 5, exited_at=NOW - 1, exit_code=-4, exit_signal=4,
     failure_times=[NOW - 1], log_path="/s/replicas/r1/engine.log"), True, State.FAILED,
     "killed by SIGILL (illegal instruction: the engine binary uses CPU instructions this machine cannot run); "
     "engine log: a:/s/replicas/r1/engine.log"),
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
    # the download of a remote source's weights, before the engine starts (docs/weights.md)
    ("download queued", dict(weights_source=HF, weights_phase="queued"), True, State.DOWNLOADING,
     "queued: other downloads of this node come first"),
    ("download resolving", dict(weights_source=HF, weights_phase="resolving"), True, State.DOWNLOADING,
     f"resolving {HF}"),
    ("downloading", dict(weights_source=HF, weights_phase="downloading", weights_done=3_435_973_837,
     weights_total=8_375_186_227, weights_rate=115_343_360.0, weights_eta=42.4), True, State.DOWNLOADING,
     "41% 3.2 of 7.8 GiB, 110.0 MiB/s, ETA 42s"),
    ("download waits on another replica's", dict(weights_source=HF, weights_phase="waiting", weights_done=10,
     weights_total=100, weights_file="m.gguf"), True, State.DOWNLOADING, "another download of m.gguf on this node"),
    ("download verifying", dict(weights_source=HF, weights_phase="verifying", weights_done=100, weights_total=100),
     True, State.DOWNLOADING, "100% 0.0 of 0.0 MiB; verifying the checksum"),
    ("download failed", dict(weights_source=HF, weights_phase="failed", weights_error_kind="auth",
     weights_error="the hub refused the token", weights_failed_at=NOW - 1, failure_times=[NOW - 1],
     next_restart_at=NOW + 1), True, State.FAILED, "download failed (auth): the hub refused the token"),
    ("downloads failing too often", dict(weights_source=HF, weights_phase="failed", weights_error_kind="not_found",
     weights_error="no repository o/r", failure_times=[NOW - 30, NOW - 10, NOW - 1]), True, State.CRASHLOOP,
     "3 failures in 60s; last: download failed (not_found): no repository o/r"),
    ("retrying a failed download", dict(weights_source=HF, weights_phase="resolving", weights_error_kind="auth",
     weights_error="x", failure_times=[NOW - 30, NOW - 10, NOW - 1]), True, State.DOWNLOADING, "resolving"),
    ("weights local, engine not started yet", dict(weights_source=HF, weights_phase="complete",
     weights_local_at=NOW - 1, weights_path="/w/m.gguf"), True, State.LAUNCHING, "agent"),
    ("weights local, engine starting", dict(weights_source=HF, weights_phase="complete", weights_local_at=NOW - 2,
     started_at=NOW - 1, pid=10), True, State.STARTING, ""),
    ("weights local, engine exited", dict(weights_source=HF, weights_phase="complete", weights_local_at=NOW - 9,
     started_at=NOW - 5, exited_at=NOW - 1, exit_code=1, failure_times=[NOW - 1]), True, State.FAILED, "code 1"),
    ("stop requested while downloading", dict(weights_source=HF, weights_phase="downloading",
     stop_requested_at=NOW - 1, stopped_at=NOW - 0.5), True, State.STOPPED, ""),
    ("downloading, node gone", dict(weights_source=HF, weights_phase="downloading"), False, State.LOST, "heartbeats"),
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
