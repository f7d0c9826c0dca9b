"""The control plane on real processes: redis-server, a control worker, beat and three node agents
running sim engines. Replicas are placed (GPU bin-packed, CPU spread), become Ready, are published;
a drained node is emptied without losing Ready replicas; a dead node's replicas are replaced."""

from __future__ import annotations

import json
import time

import pytest

from llmgw.state.replica_state import State, derive, nodes_alive
from harness.procs import wait_until

CATALOG = """
models:
  - name: gpt
    aliases: [gpt-sim]
    profiles:
      - name: h100
        engine: sim
        replicas: 2
        gpu: {class: h100, count: 1}
        args: ["--startup-delay", "0.2"]
        start_timeout: 30
  - name: tiny
    profiles:
      - name: cpu
        engine: sim
        replicas: 2
        pool: cpu
        args: ["--startup-delay", "0.2"]
        start_timeout: 30
"""

FAST_AGENT = {
    "LLMGW_AGENT_TICK": "0.2",
    "LLMGW_AGENT_STOP_GRACE": "3",
    "LLMGW_AGENT_PROBE_INTERVAL": "0.3",
    "LLMGW_AGENT_SCRAPE_INTERVAL": "0.5",
}


def replicas(cluster):
    store = cluster.store()
    live = store.live_nodes()
    out = []
    for rec in store.all_replicas():
        out.append((rec, derive(rec, nodes_alive(rec, live), time.time()).state))
    return out


def ready(cluster, model=None):
    return [r for r, st in replicas(cluster) if st is State.READY and model in (None, r.model)]


def status(cluster) -> dict:
    return json.loads(cluster.llmgw("status", "--json").stdout)


@pytest.mark.slow
def test_placement_publish_drain_and_node_loss(cluster):
    cluster.start_redis()
    cluster.start_node("a", gpus="h100:2", **FAST_AGENT)
    cluster.start_node("b", gpus="h100:2", **FAST_AGENT)
    cluster.start_node("c", pool="cpu", **FAST_AGENT)
    cluster.start_node("d", pool="cpu", **FAST_AGENT)
    store = cluster.store()
    wait_until(lambda: len(store.live_nodes()) == 4, 30, what="four node heartbeats")
    cluster.apply_catalog(CATALOG)
    cluster.start_control()
    cluster.start_beat()

    # Everything comes up: GPU replicas bin-packed onto one node, CPU replicas spread.
    wait_until(lambda: len(ready(cluster)) == 4, 60, what="four Ready replicas")
    gpt = ready(cluster, "gpt")
    assert {r.node for r in gpt} == {"a"}, [(r.id, r.node, r.gpus) for r in gpt]
    assert sorted(i for r in gpt for i in r.gpus["a"]) == [0, 1]
    assert sorted(r.node for r in ready(cluster, "tiny")) == ["c", "d"]

    # Published: the gateway's list has exactly the Ready replicas.
    def published():
        _v, _fp, eps = store.read_endpoints()
        return sorted(e.id for e in eps) == sorted(r.id for r in ready(cluster)) and len(eps) == 4

    wait_until(published, 20, what="the four endpoints to be published")
    eps = store.read_endpoints().endpoints
    assert {e.models for e in eps if e.model == "gpt"} == {("gpt", "gpt-sim")}

    report = status(cluster)
    nodes = {n["name"]: n for n in report["nodes"]}
    assert nodes["a"]["gpus"]["h100"] == {"total": 2, "used": 2, "free": 0}
    assert report["endpoints"]["count"] == 4

    # Drain a: its GPU replicas move to b, and gpt never has fewer than... one Ready replica.
    cluster.llmgw("node", "drain", "a")
    low = 2

    def drained():
        nonlocal low
        low = min(low, len(ready(cluster, "gpt")))
        rs = [r for r, st in replicas(cluster) if r.model == "gpt"]
        return len(ready(cluster, "gpt")) == 2 and all(r.node == "b" for r in rs)

    wait_until(drained, 60, interval=0.1, what="a to be drained onto b")
    assert low >= 1, "the drain took gpt to zero Ready replicas"
    assert json.loads(cluster.llmgw("status", "--json").stdout)["nodes"][0]["draining"]
    assert cluster.llmgw("node", "cordon", "nope", check=False).returncode == 2

    # Node d dies (agent and its engines): its tiny replica is Lost, then replaced on c.
    cluster.procs.get("node-d").stop()
    wait_until(
        lambda: sorted(r.node for r in ready(cluster, "tiny")) == ["c", "c"],
        60, what="d's replica to be replaced on c",
    )

    def only_live_published():
        return all(e.node != "d" for e in store.read_endpoints().endpoints) and len(store.read_endpoints().endpoints) == 4

    wait_until(only_live_published, 20, what="the endpoint list to drop d")

    # A spec change rolls tiny over to new replicas, never dropping to zero Ready ones.
    v2 = CATALOG.replace('pool: cpu\n        args: ["--startup-delay", "0.2"]',
                         'pool: cpu\n        args: ["--startup-delay", "0.4"]')
    assert v2 != CATALOG
    old_ids = {r.id for r in ready(cluster, "tiny")}
    assert len(old_ids) == 2
    cluster.apply_catalog(v2, name="catalog-v2.yaml")
    low_tiny = 2

    def rolled():
        nonlocal low_tiny
        now_ready = ready(cluster, "tiny")
        low_tiny = min(low_tiny, len(now_ready))
        return len(now_ready) == 2 and not old_ids & {r.id for r, _ in replicas(cluster)}

    wait_until(rolled, 60, interval=0.1, what="tiny to roll over to the new spec")
    assert low_tiny >= 1, "the rolling update took tiny to zero Ready replicas"

    # The per-node index (what each agent reads) agrees with the records on real Redis: built by the
    # first pass, then kept by every create, placement and delete.
    assert store.replica_node_index_ready()

    def index_agrees():
        on = {n: sorted(r.id for r in store.replicas_on(n)) for n in "abcd"}
        return on == {n: sorted(r.id for r, _ in replicas(cluster) if n in r.all_nodes) for n in "abcd"}

    wait_until(index_agrees, 10, what="the per-node index to match the records")


CRASHING = """
models:
  - name: broken
    profiles:
      - name: cpu
        engine: sim
        replicas: 1
        args: ["--fail-start"]
"""


@pytest.mark.slow
def test_a_crash_looping_replica_is_moved_to_another_node(cluster):
    cluster.start_redis()
    fast = {**FAST_AGENT, "LLMGW_AGENT_BACKOFF_BASE": "0.1", "LLMGW_AGENT_BACKOFF_CAP": "0.5"}
    cluster.start_node("a", **fast)
    store = cluster.store()
    wait_until(lambda: len(store.live_nodes()) == 1, 30, what="a's heartbeat")
    cluster.apply_catalog(CRASHING)
    cluster.start_control()
    cluster.start_beat()

    # Alone, it stays where it is: the agent keeps restarting it, the control plane has nowhere to go.
    first = wait_until(
        lambda: next((r for r, st in replicas(cluster) if st is State.CRASHLOOP), None), 60,
        what="the replica to be in CrashLoop",
    )
    assert first.node == "a" and first.stop_requested_at is None
    # (The agent keeps restarting it, so it flips between CrashLoop and Starting.)
    wait_until(lambda: "CrashLoop" in cluster.llmgw("status").stdout, 30, what="status to show the CrashLoop")
    assert store.get_replica(first.id).stop_requested_at is None

    cluster.start_node("b", **fast)

    def moved():
        recs = {r.id: r for r, _ in replicas(cluster)}
        old = recs.get(first.id)
        new = [r for r in recs.values() if r.id != first.id and r.stop_requested_at is None]
        return (old is None or old.stop_requested_at is not None) and new and new[0].node == "b" and new[0]

    new = wait_until(moved, 60, what="the crash-looping replica to move to b")
    assert new.model == "broken"


ONE_GPU = """
models:
  - name: solo
    profiles:
      - name: h100
        engine: sim
        replicas: 1
        gpu: {class: h100, count: 1}
        args: ["--startup-delay", "0.2"]
        start_timeout: 30
"""


@pytest.mark.slow
def test_an_agent_restart_slower_than_the_ttl_keeps_its_engines(cluster):
    """kill -9 the only GPU node's agent: its replica turns Lost and a replacement is recorded at once
    (Pending: no other node has a GPU), but nothing asks the old engine to stop. The agent comes back
    within the grace, re-adopts the engine, and the surplus rule drops the Pending replacement."""
    cluster.start_redis()
    cluster.start_node("a", gpus="h100:1", **FAST_AGENT)
    cluster.start_node("b", **FAST_AGENT)  # CPU only: live, but no room for the replacement
    cluster.start_control()
    cluster.start_beat()
    cluster.apply_catalog(ONE_GPU)
    store = cluster.store()
    (first,) = wait_until(lambda: ready(cluster, "solo"), 60, what="solo to be Ready")
    engine_pid = first.engine_pid
    assert engine_pid

    cluster.procs.get("node-a").kill9()

    def lost_and_replaced():
        recs = {r.id: (r, st) for r, st in replicas(cluster)}
        old = recs.get(first.id)
        pending = [r for r, st in recs.values() if r.id != first.id and st is State.PENDING]
        return old and old[1] is State.LOST and pending

    wait_until(lost_and_replaced, 30, interval=0.1, what="the replica to be Lost and replaced")
    assert store.get_replica(first.id).stop_requested_at is None  # no stop while it may come back

    cluster.start_node("a", gpus="h100:1", **FAST_AGENT)

    def readopted():
        recs = [r for r, _ in replicas(cluster)]
        return [r.id for r in recs] == [first.id] and [r.id for r in ready(cluster, "solo")] == [first.id]

    wait_until(readopted, 30, interval=0.1, what="the old replica to be Ready again and the replacement gone")
    rec = store.get_replica(first.id)
    assert rec.stop_requested_at is None and rec.engine_pid == engine_pid  # the same engine, adopted
