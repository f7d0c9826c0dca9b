"""The node agent on real processes: a real redis-server, a real node worker, real sim engines.

The test plays the control plane: it applies a catalog, writes replica records with
Store.create_replica and sends `llmgw.launch`/`llmgw.stop` the way the reconciler does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
import requests

from llmgw.proc.ports import ephemeral_range
from llmgw.proc.proctable import is_same_process, read_proc
from llmgw.state.keys import node_queue
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State, derive
from harness.procs import wait_until

CATALOG = """
models:
  - name: tiny
    profiles:
      - name: sim
        engine: sim
        replicas: 0
        args: ["--startup-delay", "0.2"]
        start_timeout: 20
  - name: broken
    profiles:
      - name: sim
        engine: sim
        replicas: 0
        args: ["--fail-start"]
"""

FAST_AGENT = {
    "LLMGW_AGENT_TICK": "0.2",
    "LLMGW_AGENT_STOP_GRACE": "3",
    "LLMGW_AGENT_PROBE_INTERVAL": "0.3",
    "LLMGW_AGENT_SCRAPE_INTERVAL": "0.5",
}


def _send(cluster, task: str, rid: str, node: str = "a") -> None:
    from llmgw.settings import ControlSettings
    from workers.celery_app import create_celery_app

    app = create_celery_app(ControlSettings(redis_url=cluster.redis_url))
    try:
        app.send_task(task, args=[rid], queue=node_queue(node))
    finally:
        app.close()


def _create(cluster, rid: str, model: str = "tiny", node: str = "a") -> None:
    cluster.store().create_replica(ReplicaRecord(
        id=rid, model=model, profile="sim", node=node, nodes=[node], created_at=time.time()))
    _send(cluster, "llmgw.launch", rid, node)


def _state(cluster, rid: str) -> State | None:
    rec = cluster.store().get_replica(rid)
    return derive(rec, True, time.time()).state if rec else None


def _ready(cluster, rid: str):
    rec = cluster.store().get_replica(rid)
    if rec and derive(rec, True, time.time()).state is State.READY:
        return rec
    return None


def _up(cluster, **env):
    cluster.start_redis()
    cluster.apply_catalog(CATALOG)
    return cluster.start_node("a", **{**FAST_AGENT, **env})


def test_launch_ready_then_adopted_after_kill9(cluster):
    node = _up(cluster)
    wait_until(lambda: "a" in cluster.store().live_nodes(), 20, what="node a's heartbeat")
    _create(cluster, "r-tiny-1")
    rec = wait_until(lambda: _ready(cluster, "r-tiny-1"), 30, what="the replica to be Ready")
    assert requests.get(rec.url + "/health", timeout=2).status_code == 200
    assert is_same_process(rec.pid, rec.pid_start, "r-tiny-1")
    # Load is scraped and written.
    load = wait_until(lambda: cluster.store().loads(["r-tiny-1"]).get("r-tiny-1"), 10, what="a load record")
    assert load.ok, load

    # kill -9 the agent: the engine keeps serving.
    node.kill9()
    assert is_same_process(rec.pid, rec.pid_start, "r-tiny-1")
    assert requests.get(rec.url + "/health", timeout=2).status_code == 200

    # A new agent adopts it: same pid, no restart.
    cluster.start_node("a", **FAST_AGENT, LLMGW_PORT_RANGE=f"{rec.port}-{rec.port + 20}")
    adopted = wait_until(lambda: (r := cluster.store().get_replica("r-tiny-1")) and r.adopted_at and r,
                         20, what="adopted_at to be written")
    assert adopted.pid == rec.pid and adopted.attempt == rec.attempt and adopted.restarts == 0
    assert requests.get(rec.url + "/health", timeout=2).status_code == 200
    wait_until(lambda: _ready(cluster, "r-tiny-1"), 10, what="still Ready after adoption")


def test_engine_crash_restarts_with_backoff_and_stop(cluster):
    _up(cluster)
    _create(cluster, "r-crash")
    rec = wait_until(lambda: _ready(cluster, "r-crash"), 30, what="Ready")
    assert rec.engine_pid or wait_until(lambda: cluster.store().get_replica("r-crash").engine_pid, 5)
    engine_pid = cluster.store().get_replica("r-crash").engine_pid
    os.kill(engine_pid, signal.SIGKILL)
    failed = wait_until(lambda: (r := cluster.store().get_replica("r-crash")) and r.failure_times and r, 10,
                        what="the crash to be recorded")
    assert failed.exit_signal == signal.SIGKILL and failed.restarts == 1
    assert failed.next_restart_at == pytest.approx(failed.exited_at + 1.0, abs=0.01)
    again = wait_until(lambda: (r := _ready(cluster, "r-crash")) and r.attempt == rec.attempt + 1 and r,
                       30, what="restarted and Ready again")
    assert again.pid != rec.pid
    assert again.started_at >= failed.next_restart_at - 0.05

    # `llmgw logs`: the live file on the replica's own machine, the recorded tail elsewhere.
    here = cluster.llmgw("logs", "r-crash", "-n", "1000", LLMGW_STATE_DIR=str(cluster.root / "nodes" / "a"))
    assert "attempt 1: starting" in here.stdout and "attempt 2: starting" in here.stdout
    elsewhere = cluster.llmgw("logs", "r-crash")
    assert "engine exited by signal 9" in elsewhere.stdout and "runs on node a" in elsewhere.stderr

    # Stop: SIGTERM through the shim, stopped_at recorded, the process gone.
    cluster.store().update_replica("r-crash", stop_requested_at=time.time(), stop_reason="test")
    _send(cluster, "llmgw.stop", "r-crash")
    stopped = wait_until(lambda: (r := cluster.store().get_replica("r-crash")) and r.stopped_at and r, 15,
                         what="stopped_at")
    assert _state(cluster, "r-crash") is State.STOPPED
    assert not is_same_process(again.pid, again.pid_start, "r-crash")
    assert stopped.exit_code is not None and stopped.exited_at >= stopped.started_at
    assert len(stopped.failure_times) == 1, "a requested stop is not a failure"


def test_a_restart_whose_port_another_program_took_starts_on_another_port(cluster):
    """Issue 57: the engine's port is taken while it is down (here by a listener, as another program
    would): the restart takes another port, records it and serves there; it is one failure (the
    crash), not a crash loop on a port that refuses the bind."""
    _up(cluster)
    _create(cluster, "r-moved")
    rec = wait_until(lambda: (r := _ready(cluster, "r-moved")) and r.engine_pid and r, 30, what="Ready")
    os.kill(rec.engine_pid, signal.SIGKILL)
    taker = socket.socket()
    try:
        taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wait_until(lambda: taker.bind(("127.0.0.1", rec.port)) is None, 10, interval=0.005,
                   what="the engine's port to come free")
        taker.listen()
        again = wait_until(lambda: (r := _ready(cluster, "r-moved")) and r.attempt == rec.attempt + 1 and r, 30,
                           what="restarted and Ready on another port")
        assert again.port != rec.port and again.url == f"http://127.0.0.1:{again.port}"
        assert again.restarts == 1 and len(again.failure_times) == 1
        assert requests.get(again.url + "/health", timeout=2).status_code == 200
    finally:
        taker.close()


def test_agent_warns_in_one_line_when_its_port_range_overlaps_the_ephemeral_range(cluster):
    ephemeral = ephemeral_range()
    if ephemeral is None:
        pytest.skip("no readable net.ipv4.ip_local_port_range here")
    lo = ephemeral[0]
    cluster.start_redis()
    node = cluster.start_node("a", **FAST_AGENT, LLMGW_PORT_RANGE=f"{lo}-{lo + 19}")
    line = (f"LLMGW_PORT_RANGE {lo}-{lo + 19} overlaps the kernel's ephemeral port range "
            f"{ephemeral[0]}-{ephemeral[1]} (net.ipv4.ip_local_port_range) by 20 ports")
    wait_until(lambda: line in node.log(200), 30, what="the agent's warning")
    assert "node agent for a started" in node.log(200)


def test_always_failing_engine_ends_in_crashloop(cluster):
    _up(cluster, LLMGW_AGENT_BACKOFF_BASE="0.2", LLMGW_AGENT_BACKOFF_CAP="0.5")
    _create(cluster, "r-broken", model="broken")
    wait_until(lambda: _state(cluster, "r-broken") is State.CRASHLOOP, 40, what="CrashLoop")
    rec = cluster.store().get_replica("r-broken")
    assert rec.exit_code not in (None, 0)
    assert len(rec.failure_times) >= 4 and rec.log_tail


def test_deleted_record_stops_its_engine_and_sigterm_stops_all(cluster):
    node = _up(cluster)
    _create(cluster, "r-del")
    _create(cluster, "r-keep")
    gone = wait_until(lambda: _ready(cluster, "r-del"), 30, what="r-del Ready")
    # Wait for engine_pid too: without it the engine check below would pass trivially.
    kept = wait_until(lambda: (r := _ready(cluster, "r-keep")) and r.engine_pid and r, 30, what="r-keep Ready")
    cluster.store().delete_replica("r-del")
    wait_until(lambda: not is_same_process(gone.pid, gone.pid_start, "r-del"), 15,
               what="the orphaned engine to be stopped")
    assert is_same_process(kept.pid, kept.pid_start, "r-keep")
    # A graceful stop of the worker stops its engines (the leak detector checks nothing is left).
    assert node.stop() == 0
    assert not is_same_process(kept.pid, kept.pid_start, "r-keep")
    assert (info := read_proc(kept.engine_pid)) is None or info.exited
    rec = cluster.store().get_replica("r-keep")
    assert rec.exited_at is not None and not rec.failure_times


def test_exit_file_written_by_shim(cluster, tmp_path):
    node = _up(cluster)
    _create(cluster, "r-exit")
    rec = wait_until(lambda: _ready(cluster, "r-exit"), 30, what="Ready")
    node.kill9()  # the agent is gone: only the shim can tell how the engine ends
    os.kill(cluster.store().get_replica("r-exit").engine_pid, signal.SIGTERM)
    exit_file = cluster.root / "nodes" / "a" / "replicas" / "r-exit" / "exit.json"
    data = wait_until(lambda: exit_file.exists() and json.loads(exit_file.read_text()), 10, what="exit.json")
    assert data["attempt"] == rec.attempt and data["pid"] == rec.pid
    cluster.start_node("a", **FAST_AGENT)
    r = wait_until(lambda: (x := cluster.store().get_replica("r-exit")) and x.failure_times and x, 20,
                   what="the new agent to record the exit from exit.json")
    assert r.exited_at == pytest.approx(data["exited_at"])


def test_keep_engines_across_a_planned_restart(cluster):
    node = _up(cluster, LLMGW_AGENT_KEEP_ENGINES="1")
    _create(cluster, "r-keep")
    rec = wait_until(lambda: _ready(cluster, "r-keep"), 30, what="Ready")
    assert node.stop() == 0  # graceful: SIGTERM
    assert is_same_process(rec.pid, rec.pid_start, "r-keep"), "LLMGW_AGENT_KEEP_ENGINES=1 keeps engines"
    cluster.start_node("a", **FAST_AGENT)  # without the knob: this one stops them at teardown
    adopted = wait_until(lambda: (r := cluster.store().get_replica("r-keep")) and r.adopted_at and r, 20,
                         what="adoption")
    assert adopted.pid == rec.pid and adopted.restarts == 0


def test_wrong_node_queue_fails_loudly_and_control_runs_no_agent(cluster):
    cluster.start_redis()
    bad = cluster.start_node("b", LLMGW_NODE="a")
    control = cluster.start_control()
    wait_until(lambda: not bad.alive(), 30, what="the misconfigured worker to exit")
    assert bad.popen.returncode != 0
    assert "LLMGW_NODE" in bad.log(200) and "node-b" in bad.log(200)
    assert "Traceback" not in bad.log(200)
    wait_until(lambda: "ready." in control.log(200), 30, what="the control worker")
    assert "node agent" not in control.log(200)
    assert not cluster.store().live_nodes()


def test_shim_killed_leaves_no_stray_engine(cluster):
    _up(cluster)
    _create(cluster, "r-shim")
    rec = wait_until(lambda: (r := _ready(cluster, "r-shim")) and r.engine_pid and r, 30, what="Ready")
    os.kill(rec.pid, signal.SIGKILL)  # the shim, not the engine: nobody will write exit.json
    wait_until(lambda: (i := read_proc(rec.engine_pid)) is None or i.exited, 10,
               what="the engine left behind by its shim to be killed")
    again = wait_until(lambda: (r := _ready(cluster, "r-shim")) and r.attempt == rec.attempt + 1 and r, 30,
                       what="a new attempt Ready")
    assert again.restarts == 1 and again.failure_times
    assert again.port == rec.port  # its port was freed and kept


def test_redis_outage_leaves_engines_serving(cluster):
    node = _up(cluster)
    _create(cluster, "r-outage")
    rec = wait_until(lambda: _ready(cluster, "r-outage"), 30, what="Ready")
    cluster.stop_redis()
    wait_until(lambda: "agent pass failed" in node.log(400), 10, what="the agent to notice the outage")
    assert requests.get(rec.url + "/health", timeout=2).status_code == 200
    cluster.restart_redis()  # comes back empty: no records, no catalog
    wait_until(lambda: "a" in cluster.store().live_nodes(), 15, what="heartbeats to resume")
    assert node.alive() and is_same_process(rec.pid, rec.pid_start, "r-outage")
    assert requests.get(rec.url + "/health", timeout=2).status_code == 200
