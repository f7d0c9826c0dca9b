"""A fake GPU fleet on real processes (issue 4): three node agents describing their GPUs with
LLMGW_NODE_GPUS, sim engines, the control plane and the gateway. A rolling update keeps the model
answering (a client loop through the gateway sees no error), and a node whose agent is killed has its
replicas moved within the heartbeat TTL plus a reconcile pass; when that node comes back, its stale
engines are stopped."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from llmgw.state.replica_state import State, derive
from harness.cluster import FAST_AGENT, FAST_ENV
from harness.procs import pid_alive, wait_until

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: chat
    aliases: [chat-latest]
    profiles:
      - name: h100
        engine: sim
        replicas: 2
        gpu: {{class: h100, count: 1}}
        args: ["--startup-delay", "{delay}"]
        start_timeout: 30
"""

AGENT = {**FAST_AGENT, "LLMGW_AGENT_STOP_GRACE": "3"}
TTL = float(FAST_ENV["LLMGW_HEARTBEAT_TTL"])
PASS = float(FAST_ENV["LLMGW_RECONCILE_INTERVAL"])


def ready(cluster):
    store = cluster.store()
    live = store.live_nodes()
    return [r for r in store.all_replicas()
            if derive(r, r.node in live, time.time()).state is State.READY and r.stop_requested_at is None]


class ClientLoop(threading.Thread):
    """Sends chat completions through the gateway until stopped; keeps every error."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
        self.halt = threading.Event()
        self.ok = 0
        self.errors: list[str] = []

    def run(self):
        while not self.halt.is_set():
            try:
                resp = self.client.chat.completions.create(
                    model="chat-latest", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
                assert resp.choices[0].message.content
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is what the test reports
                self.errors.append(repr(e))

    def stop(self):
        self.halt.set()
        self.join(30)


def test_rolling_update_without_errors_and_node_loss(cluster):
    [url] = cluster.start_system(CATALOG.format(delay="0.2"), nodes=("a", "b", "c"), gpus="h100:2", node_env=AGENT)

    first = wait_until(lambda: len(ready(cluster)) == 2 and ready(cluster), 60, what="two Ready replicas")
    # Bin-packed: both one-GPU replicas on the same node, on different GPUs.
    assert len({r.node for r in first}) == 1
    assert sorted(i for r in first for i in r.gpus[r.node]) == [0, 1]

    loop = ClientLoop(url)
    wait_until(lambda: "chat-latest" in {m.id for m in loop.client.models.list().data}, 20,
               what="the gateway to list the alias")
    loop.start()
    try:
        # Rolling update: a spec change replaces both replicas one at a time.
        old = {r.id for r in first}
        cluster.apply_catalog(CATALOG.format(delay="0.3"), name="v2.yaml")
        wait_until(lambda: len(ready(cluster)) == 2 and not old & {r.id for r in cluster.store().all_replicas()},
                   90, what="the rollover to finish")
        served_during_update = loop.ok
    finally:
        loop.stop()
    assert not loop.errors, loop.errors[:5]
    print(f"{served_during_update} requests served during the rolling update, 0 errors")
    assert served_during_update > 0  # the loop really ran through the update

    # kill -9 the agent of the node holding the replicas: its engines keep running, but the node
    # is Lost once its heartbeat expires, and the replicas are placed elsewhere.
    # (After the rollover the two replicas may sit on different nodes: the surge replica went where
    # GPUs were free.)
    current = ready(cluster)
    victim = current[0].node
    stale_pids = [r.engine_pid for r in current if r.node == victim]
    killed_at = time.monotonic()
    cluster.procs.get(f"node-{victim}").kill9()

    def moved():
        recs = [r for r in cluster.store().all_replicas() if r.stop_requested_at is None]
        return len(recs) == 2 and all(r.node not in (victim, None) for r in recs)

    # TTL after the last heartbeat, plus one pass (and the time to dispatch): with a margin for a
    # loaded CI machine. The figure itself is printed for the issue notes.
    wait_until(moved, TTL + PASS + 10, interval=0.1, what="the replicas to be placed on another node")
    print(f"replicas re-placed {time.monotonic() - killed_at:.2f}s after kill -9 (TTL {TTL}s, pass {PASS}s)")
    wait_until(lambda: len(ready(cluster)) == 2 and all(r.node != victim for r in ready(cluster)), 60,
               what="the replacements to be Ready")
    # The records say Ready elsewhere a moment before the next publish pass writes the list.
    wait_until(lambda: all(e.node != victim for e in cluster.store().read_endpoints().endpoints), 10,
               what=f"no endpoint on {victim} in the published list")

    # The node comes back: its agent stops the engines whose replicas moved away.
    assert all(pid_alive(p) for p in stale_pids)
    cluster.start_node(victim, gpus="h100:2", **AGENT)
    wait_until(lambda: not any(pid_alive(p) for p in stale_pids), 60, what="the stale engines to be stopped")
