"""A multi-node replica on real processes: two node agents (`a`, `b`, one fake H100 each), the sim
engine split over both (head on one, a headless member on the other, joined over TCP like vLLM's
torch.distributed rendezvous), the control plane and the gateway. It must become Ready and be
published once (the head's URL), answer through the gateway, come back after its head engine is
killed (the member rejoins the new head attempt), and on removal stop on both nodes before its record
is deleted and its GPUs freed."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest
import requests

from llmgw.state.replica_state import State, derive
from harness.cluster import FAST_AGENT
from harness.procs import TOKEN_VAR, pid_alive, processes_with_token, wait_until

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: big
    aliases: [big-latest]
    profiles:
      - name: two-nodes
        engine: sim
        nodes: 2
        replicas: 1
        gpu: {class: h100, count: 1}
        args: ["--join-timeout", "10"]
        start_timeout: 30
"""
EMPTY = "models: []\n"

# The stop grace is what keeps the frozen member part (below) alive after the head's part stopped:
# long enough that the checks made in that window cannot outlast it on a loaded machine.
AGENT = {**FAST_AGENT, "LLMGW_AGENT_STOP_GRACE": "15", "LLMGW_AGENT_BACKOFF_BASE": "0.5"}


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def sim_parts(headless: bool) -> list[int]:
    """Pids of this test's sim engine processes (not their shims): head parts or headless members."""
    token = os.environ[TOKEN_VAR]
    return [p for p in processes_with_token(token)
            if cmdline(p)[1:3] == ["-m", "simengine"] and ("--headless" in cmdline(p)) == headless]


def the_replica(cluster):
    recs = cluster.store().all_replicas()
    return recs[0] if len(recs) == 1 else None


def ready_replica(cluster):
    store = cluster.store()
    rec = the_replica(cluster)
    if rec is None or rec.stop_requested_at is not None:
        return None
    live = store.live_nodes()
    alive = all(n in live for n in rec.all_nodes)
    return rec if derive(rec, alive, time.time()).state is State.READY else None


def gpus_free(cluster) -> dict[str, dict]:
    report = json.loads(cluster.llmgw("status", "--json").stdout)
    return {n["name"]: n["gpus"].get("h100") for n in report["nodes"]}


def head_healthy(rec) -> bool:
    try:
        return requests.get(rec.url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def answer(client, text: str):
    """A chat completion through the gateway, or None while it answers 503 (no Ready endpoint yet)."""
    try:
        return client.chat.completions.create(model="big", messages=[{"role": "user", "content": text}],
                                              max_tokens=2)
    except openai.APIStatusError as e:
        if e.status_code == 503:
            return None
        raise


def test_two_node_replica_serves_restarts_and_stops_on_both_nodes(cluster):
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    [url] = cluster.start_system(CATALOG, nodes=("a", "b"), gpus="h100:1", node_env=AGENT)
    applied = time.monotonic()

    # Placed across both nodes, head first, one GPU on each; Ready only once the member joined.
    rec = wait_until(lambda: ready_replica(cluster), 60, what="the two-node replica to be Ready")
    timings["ready"] = time.monotonic() - applied
    assert len(rec.all_nodes) == 2 and set(rec.all_nodes) == {"a", "b"} and rec.node == rec.all_nodes[0]
    assert rec.gpus == {"a": [0], "b": [0]}
    head, member = rec.all_nodes
    assert rec.master_port and rec.url and rec.engine_pid
    members = wait_until(lambda: sim_parts(headless=True), 10, what="the member part to run")
    assert len(members) == 1 and "--master-port" in cmdline(members[0])
    assert cmdline(members[0])[cmdline(members[0]).index("--master-port") + 1] == str(rec.master_port)
    assert sim_parts(headless=False) == [rec.engine_pid]

    # Published once, under the head's URL.
    _v, _fp, endpoints = wait_until(lambda: (e := cluster.store().read_endpoints())[2] and e, 20,
                                    what="the replica to be published")
    assert [(e.id, e.url, e.node) for e in endpoints] == [(rec.id, rec.url, head)]

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
    wait_until(lambda: "big-latest" in {m.id for m in client.models.list().data}, 20,
               what="the gateway to list the model")
    resp = client.chat.completions.create(model="big-latest", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4)
    assert resp.choices[0].message.content and resp.usage.completion_tokens == 4
    assert resp.system_fingerprint == f"llmgw-sim-{rec.port}"  # answered by the head's engine

    # kill -9 the head's engine: the member loses its head and exits; the head is restarted as a new
    # attempt and the member part rejoins it.
    old_attempt, old_engine, old_member = rec.attempt, rec.engine_pid, members[0]
    killed = time.monotonic()
    os.kill(old_engine, signal.SIGKILL)
    wait_until(lambda: not pid_alive(old_member), 15, what="the member part to exit after its head died")
    timings["member_exit_after_kill"] = time.monotonic() - killed

    def recovered():
        r = ready_replica(cluster)
        return r if r is not None and r.attempt > old_attempt and r.engine_pid != old_engine else None

    rec2 = wait_until(recovered, 60, what="the replica to be Ready again with a new head attempt")
    timings["ready_again_after_kill"] = time.monotonic() - killed
    new_members = sim_parts(headless=True)
    assert len(new_members) == 1 and new_members[0] != old_member
    assert rec2.id == rec.id and rec2.all_nodes == [head, member]
    # Published again (it left the list while not Ready), still once, under the head's new URL.
    wait_until(lambda: [(e.id, e.url) for e in cluster.store().read_endpoints().endpoints] == [(rec2.id, rec2.url)],
               20, what="the restarted replica to be published")
    resp = wait_until(lambda: answer(client, "again"), 20, what="the gateway to route to the restarted replica")
    assert resp.system_fingerprint == f"llmgw-sim-{rec2.port}"

    # kill -9 the member's engine: its agent restarts the part, which joins the same head attempt
    # (the sim's head only waits for the rank to come back; its liveness timeout is far away).
    killed = time.monotonic()
    os.kill(new_members[0], signal.SIGKILL)

    def member_back():
        r = ready_replica(cluster)
        m = sim_parts(headless=True)
        # The head's own /health too: the record may still say Ready from before it noticed the loss.
        return r if r is not None and m and m[0] != new_members[0] and head_healthy(r) else None

    rec3 = wait_until(member_back, 30, what="the member part to be restarted and the replica Ready again")
    timings["ready_again_after_member_kill"] = time.monotonic() - killed
    assert rec3.attempt == rec2.attempt and rec3.engine_pid == rec2.engine_pid
    assert wait_until(lambda: answer(client, "third"), 20, what="the gateway to answer after the member rejoined")

    # Remove the model. The member's engine is frozen first (SIGSTOP: deaf to SIGTERM) so its part
    # outlives the head's by the agent's stop grace: the head's confirmation alone must not free the
    # replica, the record goes only after both nodes confirmed (the member's agent SIGKILLs it).
    head_pid, member_pid = rec3.engine_pid, sim_parts(headless=True)[0]
    os.kill(member_pid, signal.SIGSTOP)
    cluster.apply_catalog(EMPTY, name="empty.yaml")
    removed = time.monotonic()
    half = wait_until(lambda: (r := the_replica(cluster)) and r.stopped_nodes == [head] and r, 15,
                      what="the head's node to confirm its part stopped")
    assert not pid_alive(head_pid) and pid_alive(member_pid)
    assert derive(half, True, time.time()).state is State.STOPPING
    assert cluster.store().read_endpoints().endpoints == []
    used = gpus_free(cluster)
    assert used[member] == {"total": 1, "used": 1, "free": 0}, used  # the member still holds its GPU

    def deleted():
        r = the_replica(cluster)
        if r is None:
            return True
        live = cluster.store().live_nodes()
        view = derive(r, all(n in live for n in r.all_nodes), time.time())
        # Never Stopped (deletable) before both nodes confirmed their own part.
        assert view.state is not State.STOPPED or sorted(r.stopped_nodes) == sorted([head, member])
        return False

    wait_until(deleted, 60, interval=0.02, what="the replica record to be deleted")
    timings["deleted_after_removal"] = time.monotonic() - removed
    # Deleted only once confirmed: by now neither part may still run.
    assert not pid_alive(member_pid) and not sim_parts(headless=True) and not sim_parts(headless=False)
    assert cluster.store().read_endpoints().endpoints == []

    def all_free():
        g = gpus_free(cluster)
        return g if set(g) == {"a", "b"} and all(v == {"total": 1, "used": 0, "free": 1} for v in g.values()) else None

    wait_until(all_free, 20, what="h100 free on both nodes")
    timings["total"] = time.monotonic() - t0
    print("multinode timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))


def test_sim_head_is_healthy_only_with_its_member_and_member_follows_head(tmp_path):
    """The sim's rendezvous on real processes, without the control plane: /health is 503 until the
    member joins and again after it leaves; a member exits 1 when its head dies or never appears."""
    from harness.procs import ProcessSet, free_port, python

    procs = ProcessSet(tmp_path / "logs")
    port, master = free_port(), free_port()
    sim = [python(), "-m", "simengine", "--host", "127.0.0.1", "--served-model-name", "big"]
    multi = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master)]
    url = f"http://127.0.0.1:{port}/health"

    def health():
        try:
            r = requests.get(url, timeout=1)
            return r.status_code, r.text
        except requests.ConnectionError:
            return None, ""

    try:
        lonely = procs.start("lonely", [*sim, "--port", str(free_port()), *multi, "--node-rank", "1", "--headless",
                                        "--join-timeout", "0.5"])
        assert wait_until(lambda: lonely.popen.poll() is not None and lonely.popen.returncode, 10,
                          what="a member without a head to give up") == 1
        assert "cannot join the head" in lonely.log()

        head = procs.start("head", [*sim, "--port", str(port), *multi, "--node-rank", "0"])
        status, text = wait_until(lambda: (h := health())[0] and h, 15, what="the head to answer")
        assert status == 503 and "rank(s) 1 of 2" in text
        member = procs.start("member", [*sim, "--port", str(free_port()), *multi, "--node-rank", "1", "--headless"])
        wait_until(lambda: health()[0] == 200, 15, what=f"the head to be healthy once rank 1 joined\n{head.log()}")
        member.stop()
        assert member.popen.returncode == 0  # asked to stop (SIGTERM): a clean exit
        wait_until(lambda: health()[0] == 503, 10, what="the head to be unready without its member")
        member = procs.start("member2", [*sim, "--port", str(free_port()), *multi, "--node-rank", "1", "--headless"])
        wait_until(lambda: health()[0] == 200, 15, what="the head to be healthy again")
        head.kill9()
        assert wait_until(lambda: member.popen.poll() is not None and member.popen.returncode, 10,
                          what="the member to exit after its head died") == 1
        assert "closed the connection" in member.log() or "lost the head" in member.log()
    finally:
        procs.stop_all()
