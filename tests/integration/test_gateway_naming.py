"""An answer names the model the client asked for, whatever name the engine answers with: the real
sim engine told to answer as llama-server does ("default"), behind the gunicorn gateway; whole
answers and every streamed chunk, chat, completions and responses, by name and by alias."""

from __future__ import annotations

import time

import openai
import requests

from llmgw.catalog import Profile
from llmgw.engines import ENGINES
from llmgw.state.records import EndpointInfo
from harness.procs import free_port, python, wait_until

FAST = {"LLMGW_GATEWAY_POLL_INTERVAL": "0.2"}


def test_answers_name_the_model_the_client_asked_for(cluster):
    cluster.start_redis()
    port = free_port()
    cluster.procs.start("sim", [python(), "-m", "simengine", "--port", str(port), "--step-ms", "1",
                                "--served-model-name", "served-m", "--answer-model", "default"], env=cluster.env())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 20, what="the sim engine")
    ep = EndpointInfo(id="sim", url=url, models=("smollm2", "smol"), engine="sim", model="smollm2",
                      served_name="served-m", capacity=8,
                      paths=ENGINES["sim"].paths(Profile(name="sim", engine="sim")))
    cluster.store().write_endpoints([ep], "fp", time.time())
    gw = cluster.start_gateway(**FAST)
    wait_until(lambda: requests.get(gw + "/healthz", timeout=5).json()["endpoints"] == 1, 10, what="the list")
    client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0, timeout=30)
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}

    raw = requests.post(url + "/v1/chat/completions", json={"model": "served-m", **ask}, timeout=10).json()
    assert raw["model"] == "default"  # what the engine itself says
    for name in ("smollm2", "smol"):
        assert client.chat.completions.create(model=name, **ask).model == name
        chunks = list(client.chat.completions.create(model=name, stream=True,
                                                     stream_options={"include_usage": True}, **ask))
        assert len(chunks) > 3 and {c.model for c in chunks} == {name}
        assert chunks[-1].usage.completion_tokens == 12
        assert client.completions.create(model=name, prompt="hello", max_tokens=3).model == name
        assert {c.model for c in client.completions.create(model=name, prompt="hello", max_tokens=3,
                                                           stream=True)} == {name}
        assert client.responses.create(model=name, input="hi", max_output_tokens=4).model == name
        events = list(client.responses.create(model=name, input="hi", max_output_tokens=4, stream=True))
        named = [e.response.model for e in events if getattr(e, "response", None) is not None]
        assert named and set(named) == {name}
