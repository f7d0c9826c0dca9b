"""The whole path on real parts: redis-server, a control worker, beat, two node agents, sim engines
and the gateway under gunicorn, driven by the official openai SDK."""

from __future__ import annotations

import os
import signal

import openai
import pytest
import requests

from harness.procs import pid_alive, wait_until

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: tiny
    aliases: [tiny-alias]
    profiles:
      - name: sim
        engine: sim
        replicas: 2
"""

EMPTY_CATALOG = "models: []\n"


def listed_models(url: str) -> set[str]:
    resp = requests.get(url + "/v1/models", timeout=2)
    resp.raise_for_status()
    return {m["id"] for m in resp.json()["data"]}


def ready_replicas(cluster, model: str):
    import time

    from llmgw.state.replica_state import State, derive

    store = cluster.store()
    live = store.live_nodes()
    out = []
    for rec in store.all_replicas():
        if rec.model == model and derive(rec, rec.node in live, time.time()).state is State.READY:
            out.append(rec)
    return out


def test_two_nodes_sim_model_end_to_end(cluster):
    [url] = cluster.start_system(CATALOG, nodes=("a", "b"))

    wait_until(lambda: {"tiny", "tiny-alias"} <= listed_models(url), 60,
               what="the gateway to list tiny and its alias")
    replicas = wait_until(lambda: len(ready_replicas(cluster, "tiny")) == 2 and ready_replicas(cluster, "tiny"),
                          60, what="two Ready replicas")
    # CPU replicas are spread: one per node.
    assert sorted(r.node for r in replicas) == ["a", "b"]

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    for name in ("tiny", "tiny-alias"):
        resp = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=8)
        assert resp.choices[0].message.content
        assert resp.usage.completion_tokens > 0
        chunks = list(client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(chunks) >= 3 and text  # token by token, not one buffered blob

    # kill -9 one engine: the model keeps answering, and the replica is restarted.
    victim = replicas[0]
    assert victim.engine_pid and pid_alive(victim.engine_pid)
    os.kill(victim.engine_pid, signal.SIGKILL)
    for _ in range(20):
        resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}],
                                              max_tokens=4)
        assert resp.choices[0].message.content

    def replaced():
        rec = cluster.store().get_replica(victim.id)
        ready_ids = {r.id for r in ready_replicas(cluster, "tiny")}
        return (rec is not None and rec.restarts >= 1 and rec.engine_pid != victim.engine_pid
                and len(ready_ids) == 2)

    wait_until(replaced, 60, what="the killed engine to be restarted and Ready again")

    # Remove the model: it leaves /v1/models and its engines exit.
    engine_pids = [r.engine_pid for r in ready_replicas(cluster, "tiny")]
    cluster.apply_catalog(EMPTY_CATALOG, name="empty.yaml")
    wait_until(lambda: listed_models(url) == set(), 30, what="tiny to leave /v1/models")
    resp = requests.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=5)
    assert resp.status_code == 404 and resp.json()["error"]["message"]
    wait_until(lambda: not any(pid_alive(p) for p in engine_pids), 30, what="the engines to exit")
    wait_until(lambda: not cluster.store().all_replicas(), 30, what="the replica records to be deleted")
