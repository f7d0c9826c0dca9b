"""The gateway's KV event subscriber against a real simulated engine publishing on vLLM's wire: what
the index says a replica holds is what the engine reports, including what it cached before the
gateway listened (the replay), and an engine that starts again is known to be empty."""

from __future__ import annotations

import threading

import pytest
import requests

from gateway.routing.kvindex import Index, SharedIndex
from gateway.routing.precise import cached_tokens
from gateway.server.kvevents import KvSubscriber
from gateway.server.tokenizers import Tokenizers
from llmgw.engines import tokenize_prompt
from llmgw.state.records import EndpointInfo
from harness.procs import ProcessSet, free_port, python, wait_until

TOKENIZERS = Tokenizers({})  # the simulated engine's tokenizer is built in
SYSTEM = {"role": "system", "content": "You are the billing assistant of a shop; answer politely. " * 20}


@pytest.fixture
def procs(tmp_path):
    ps = ProcessSet(tmp_path / "logs")
    yield ps
    ps.stop_all()


def start_sim(procs, port: int, pub: int, replay: int, name: str = "sim"):
    p = procs.start(name, [python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m",
                           "--step-ms", "2", "--kv-events-endpoint", f"tcp://*:{pub}",
                           "--kv-events-replay-endpoint", f"tcp://*:{replay}"])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15, what=f"sim\n{p.log()}")
    return p, url


def with_traffic(url: str, cond, what: str) -> None:
    """Wait for `cond`, sending the engine a prompt that shares nothing before each look: a SUB socket
    joins late (what was published before it is lost to it; the replay has it), and an engine
    publishes only when its cache changes."""
    n = iter(range(10_000))
    wait_until(lambda: ask(url, [{"role": "user", "content": f"one-shot prompt number {next(n)} " * 6}]) and cond(),
               15, interval=0.3, what=what)


def hear_from(url: str, index: Index, ep: EndpointInfo) -> None:
    with_traffic(url, lambda: index.listening(ep.id), "the subscriber to hear from the engine")


def ask(url: str, messages: list[dict]) -> str:
    r = requests.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 8},
                      timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture
def observed():
    """What the subscriber last told its observer (the gateway's metrics) per endpoint."""
    return {}


@pytest.fixture
def subscriber(observed):
    shared = SharedIndex()
    endpoints: list[EndpointInfo] = []
    sub = KvSubscriber(shared, lambda: tuple(endpoints), observe=lambda eid, *at: observed.__setitem__(eid, at))
    sub.start()
    yield shared.index, shared.lock, endpoints
    sub.stop()
    sub.thread.join(5)


def held(index, lock, ep, messages) -> int:
    with lock:
        return cached_tokens(index, [ep], "chat", {"messages": messages}, TOKENIZERS.tokenize)[0][ep.id]


def test_the_index_holds_what_the_engine_cached_even_before_the_gateway_listened(procs, subscriber, observed):
    index, lock, endpoints = subscriber
    port, pub, replay = free_port(), free_port(), free_port()
    _, url = start_sim(procs, port, pub, replay)
    first = [SYSTEM, {"role": "user", "content": "where is my invoice for order 1234?"}]
    answer = ask(url, first)  # cached before anyone subscribed: only the replay has it
    ep = EndpointInfo("e0", url, ("m",), "sim", kv_events=f"tcp://127.0.0.1:{pub}",
                      kv_replay=f"tcp://127.0.0.1:{replay}")
    endpoints.append(ep)
    hear_from(url, index, ep)  # it sees the batches start past 0, and replays the rest
    turn2 = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and the refund?"}]
    # The second turn's history (system prompt, first question, the answer) is cached on the engine.
    prompt_len = len(tokenize_prompt("sim", "chat", {"messages": turn2}))
    wait_until(lambda: held(index, lock, ep, turn2) >= prompt_len - 40, 15,
               what=f"the index to hold turn 1's prefix (holds {held(index, lock, ep, turn2)} of {prompt_len})")
    assert index.gaps.get(ep.id, 0) == 0
    # What the index has folded in, as the gateway's metrics show it (llmgw_gateway_kv_index_*).
    with lock:
        at = (index.folded(ep.id), index.size(ep.id))
    assert at[0] >= 1 and at[1] > 0
    wait_until(lambda: observed.get(ep.id) == at, 5, what=f"the observer told {at} (told {observed.get(ep.id)})")
    # A different system prompt shares nothing.
    other = [{"role": "system", "content": "You are a travel agent. " * 20}, {"role": "user", "content": "hi"}]
    assert held(index, lock, ep, other) == 0


def conversation_held(procs, subscriber, content: str):
    """A sim engine publishing, subscribed to and heard from, holding one conversation the index
    knows of: (its process, its ports, the endpoint, the conversation)."""
    index, lock, endpoints = subscriber
    port, pub, replay = free_port(), free_port(), free_port()
    p, url = start_sim(procs, port, pub, replay)
    ep = EndpointInfo("e0", url, ("m",), "sim", kv_events=f"tcp://127.0.0.1:{pub}",
                      kv_replay=f"tcp://127.0.0.1:{replay}")
    endpoints.append(ep)
    hear_from(url, index, ep)
    conv = [SYSTEM, {"role": "user", "content": content}]
    ask(url, conv)
    wait_until(lambda: held(index, lock, ep, conv) > 0, 15, what="the index to hold the conversation")
    return p, (port, pub, replay), ep, conv


def test_an_engine_started_again_is_known_empty(procs, subscriber):
    index, lock, _ = subscriber
    p, ports, ep, conv = conversation_held(procs, subscriber, "first question")
    p.stop()
    start_sim(procs, *ports, "sim-again")
    fresh = [{"role": "user", "content": "a new engine's first prompt " * 8}]
    ask(ep.url, fresh)  # batch 0 of the new engine: below what the index expects
    with_traffic(ep.url, lambda: held(index, lock, ep, fresh + [{"role": "user", "content": "x"}]) > 0,
                 "the index to hear from the new engine")
    assert held(index, lock, ep, conv) == 0


def test_an_endpoint_that_leaves_the_list_is_forgotten(procs, subscriber, observed):
    index, _, endpoints = subscriber
    _, _, ep, _ = conversation_held(procs, subscriber, "a question")
    assert observed[ep.id][1] > 0
    endpoints.clear()
    wait_until(lambda: not index.listening(ep.id), 5, what="the endpoint forgotten")
    wait_until(lambda: observed[ep.id] == (-1, 0), 5, what="the observer told it is gone")
