"""Stopping a replica never cuts a request (issue 20): every planned stop unpublishes the replica,
waits until every gateway dropped it, lets in-flight requests finish, and only then stops the engine.

Real processes: redis-server, a control worker, beat, two node agents with sim engines, the gateway.
Streams last about 2 s (100 tokens at 20 ms), so every stop lands in the middle of some of them; the
client loops check every stream for its final chunk and `[DONE]`."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from llmgw.state.replica_state import State, derive, nodes_alive
from tests.support.clients import ClientLoop, start_loops, stop_loops, stream_problem
from harness.cluster import FAST_AGENT, sim_catalog
from harness.procs import pid_alive, wait_until

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: chat
    profiles:
      - name: cpu
        engine: sim
        replicas: 3
        capacity: 16
        args: ["--step-ms", "20", "--seed", "{seed}"]
        drain_timeout: 60
  - name: other
    profiles:
      - name: cpu
        engine: sim
        replicas: 1
"""

ONLY_OTHER = sim_catalog(model="other")

AGENT = {**FAST_AGENT, "LLMGW_AGENT_STOP_GRACE": "5"}
STREAM_TOKENS = 100  # about 2 s at 20 ms a token


def current(cluster, model="chat"):
    store = cluster.store()
    live = store.live_nodes()
    now = time.time()
    return [r for r in store.all_replicas()
            if r.model == model and r.stop_requested_at is None
            and derive(r, nodes_alive(r, live), now).state is State.READY]


@pytest.fixture
def fleet(cluster):
    [url] = cluster.start_system(CATALOG.format(seed=0), nodes=("a", "b"), node_env=AGENT, routed=4)
    wait_until(lambda: len(current(cluster)) == 3 and current(cluster, "other"), 60, what="4 Ready replicas")
    wait_until(lambda: requests.post(url + "/v1/chat/completions", timeout=10, json={
        "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).ok, 20,
        what="the gateway to route chat")
    return cluster, url


def test_rolling_updates_cut_no_request(fleet):
    cluster, url = fleet
    loops = start_loops(url, "chat", streaming=2, plain=2, max_tokens=STREAM_TOKENS)
    try:
        for seed in (1, 2, 3):
            old = current(cluster)
            old_pids = [r.engine_pid for r in old]
            cluster.apply_catalog(CATALOG.format(seed=seed), name=f"v{seed}.yaml")

            def rolled():
                ids = {r.id for r in cluster.store().all_replicas()}
                return len(current(cluster)) == 3 and not ids & {r.id for r in old}

            wait_until(rolled, 120, interval=0.2, what=f"rolling update {seed} to finish")
            wait_until(lambda: not any(pid_alive(p) for p in old_pids), 30, what="the old engines to exit")
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    assert served > 20, served  # the loops really ran through the updates
    print(f"3 rolling updates: {served} requests, 0 failed, 0 truncated streams")


def test_answers_that_outlast_the_drain_deadline_resume_on_the_replicas_left(fleet):
    """A rolling update whose drain deadline (1 s) is shorter than the answers (400 tokens, about
    8 s): the old engines are stopped under their streams, which resume on the replicas still
    published (issue 48), so no client sees an error or a cut answer."""
    cluster, url = fleet
    short = CATALOG.format(seed=7).replace("drain_timeout: 60", "drain_timeout: 1")
    loops = start_loops(url, "chat", streaming=6, plain=0, max_tokens=400)
    try:
        old = current(cluster)
        # Every old replica holds a stream before the update, so each stop lands under one.
        wait_until(lambda: all(any(g.endpoints.get(r.id) and g.endpoints[r.id].inflight
                                   for g in cluster.store().gateway_reports()) for r in old),
                   30, interval=0.1, what="a stream on every replica")
        cluster.apply_catalog(short, name="short-drain.yaml")
        wait_until(lambda: len(current(cluster)) == 3 and not {r.id for r in cluster.store().all_replicas()}
                   & {r.id for r in old}, 120, interval=0.2, what="the update with a 1 s drain to finish")
        wait_until(lambda: not any(pid_alive(r.engine_pid) for r in old), 30, what="the old engines to exit")
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    page = requests.get(url + "/metrics", timeout=10).text
    resumed = sum(float(line.split()[-1]) for line in page.splitlines()
                  if line.startswith('llmgw_gateway_stream_resumes_total{model="chat",outcome="resumed"'))
    assert resumed >= 1, "no stream was handed over: the test did not stop an engine under one"
    print(f"rolling update with a 1 s drain under 8 s answers: {served} answers, {resumed:.0f} resumed, 0 failed")


def test_node_drain_cuts_no_request(fleet):
    cluster, url = fleet
    loops = start_loops(url, "chat", streaming=2, plain=2, max_tokens=STREAM_TOKENS)
    try:
        on_a = [r for r in cluster.store().all_replicas() if r.node == "a"]
        assert on_a
        out = cluster.llmgw("node", "drain", "a").stdout
        assert "draining" in out
        wait_until(lambda: not [r for r in cluster.store().all_replicas() if r.node == "a"]
                   and len(current(cluster)) == 3, 120, interval=0.2, what="node a to be drained")
        wait_until(lambda: not any(pid_alive(r.engine_pid) for r in on_a), 30, what="a's engines to exit")
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    assert served > 5, served


def test_removing_a_model_lets_in_flight_requests_finish(fleet):
    cluster, url = fleet
    engines = [r.engine_pid for r in current(cluster)]
    results: list[str | None] = []

    def long_stream():
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150, "stream": True}
        try:
            with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as resp:
                results.append(f"HTTP {resp.status_code}" if resp.status_code != 200
                               else stream_problem(resp.iter_lines()))
        except requests.RequestException as e:
            results.append(repr(e))

    streams = [threading.Thread(target=long_stream) for _ in range(6)]
    for t in streams:
        t.start()
    # Every stream is on an engine (the gateway holds them) before the model goes.
    wait_until(lambda: sum(s.inflight for g in cluster.store().gateway_reports() for s in g.endpoints.values()) >= 6,
               20, interval=0.05, what="the streams to be in flight")
    cluster.apply_catalog(ONLY_OTHER, name="removed.yaml")
    probe = ClientLoop(url, "chat")
    wait_until(lambda: (probe.one() or "").startswith("HTTP 404"), 30, interval=0.1,
               what="new requests for the removed model to get 404")
    for t in streams:
        t.join(60)
    assert results == [None] * 6, results
    wait_until(lambda: not any(pid_alive(p) for p in engines), 90, what="the removed model's engines to exit")
    wait_until(lambda: not [r for r in cluster.store().all_replicas() if r.model == "chat"], 30,
               what="the removed model's records to be deleted")
