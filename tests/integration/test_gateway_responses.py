"""The Responses API and the rest of the wider surface through the gateway (gunicorn, the gevent
worker) against two real sim engines: create, stream, retrieve and delete by id from the endpoint
that created it, a conversation continued on it, usage counted, and what no endpoint serves."""

from __future__ import annotations

import time

import openai
import requests

from llmgw.catalog import Profile
from llmgw.engines import ENGINES
from llmgw.state import keys
from llmgw.state.keypolicy import ANONYMOUS
from llmgw.state.records import EndpointInfo
from harness.procs import free_port, python, wait_until

SIM_PATHS = ENGINES["sim"].paths(Profile(name="sim", engine="sim"))
FAST = {"LLMGW_GATEWAY_POLL_INTERVAL": "0.2", "LLMGW_GATEWAY_USAGE_FLUSH": "0.1", "LLMGW_GATEWAY_AUTH": "off",
        "LLMGW_GATEWAY_POLICY": "round_robin"}


def start_sim(cluster, name: str) -> str:
    port = free_port()
    cluster.procs.start(name, [python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m",
                               "--speed", "5", "--seed", str(port)], env=cluster.env())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 20, what=f"sim engine {name}")
    return url


def publish(cluster, urls: dict[str, str]) -> None:
    eps = [EndpointInfo(id=i, url=u, models=("m", "m-alias"), engine="sim", model="m", served_name="m",
                        capacity=8, paths=SIM_PATHS) for i, u in urls.items()]
    cluster.store().write_endpoints(eps, "fp-" + "-".join(sorted(urls)), time.time())


def endpoints_seen(gw: str) -> int:
    return requests.get(gw + "/healthz", timeout=5).json()["endpoints"]


def test_responses_are_created_streamed_and_read_back_from_their_endpoint(cluster):
    cluster.start_redis()
    urls = {"sim-a": start_sim(cluster, "sim-a"), "sim-b": start_sim(cluster, "sim-b")}
    publish(cluster, urls)
    gw = cluster.start_gateway(**FAST)
    wait_until(lambda: endpoints_seen(gw) == 2, 10, what="both endpoints")
    client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0, timeout=30)

    # Round robin alternates the creations, so both endpoints hold responses.
    created = {}
    for i in range(4):
        raw = client.responses.with_raw_response.create(model="m-alias", input=f"question {i}", max_output_tokens=4)
        resp = raw.parse()
        created[resp.id] = (raw.headers["X-LLMGW-Endpoint"], resp.output_text)
        assert resp.usage.input_tokens > 0 and resp.usage.output_tokens == 4
    assert {ep for ep, _ in created.values()} == {"sim-a", "sim-b"}
    for rid, (ep, text) in created.items():
        assert rid.startswith("resp_") and ep not in rid
        for _ in range(2):  # round robin would alternate: only the id leads to the right endpoint
            raw = client.responses.with_raw_response.retrieve(rid)
            assert raw.headers["X-LLMGW-Endpoint"] == ep and raw.parse().id == rid
            assert raw.parse().output_text == text

    # A stream: the ids in its events are the client's, and the stored response reads back.
    events = list(client.responses.create(model="m", input="stream it", max_output_tokens=5, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    streamed = events[-1].response
    assert events[0].response.id == streamed.id and streamed.usage.output_tokens == 5
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert client.responses.retrieve(streamed.id).output_text == deltas == streamed.output_text

    # A conversation continues on the endpoint that holds its first response.
    first_id, (first_ep, _) = next(iter(created.items()))
    raw = client.responses.with_raw_response.create(model="m", input="and then?", previous_response_id=first_id,
                                                    max_output_tokens=2)
    follow = raw.parse()
    assert raw.headers["X-LLMGW-Endpoint"] == first_ep and follow.previous_response_id == first_id

    # Usage counts what was generated (input/output tokens, like chat's), never a response read again.
    r = cluster.redis()
    wait_until(lambda: r.hget(keys.usage(ANONYMOUS), "m:completion") == str(4 * 4 + 5 + 2), 10,
               what="usage of the created responses only")

    # Deleted, then gone; an edited id is a clean 404 that reaches no engine.
    client.responses.delete(follow.id)
    r = requests.get(f"{gw}/v1/responses/{follow.id}", timeout=5)
    assert r.status_code == 404 and r.headers["X-LLMGW-Endpoint"] == first_ep
    r = requests.get(f"{gw}/v1/responses/{first_id[:-1]}x", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "X-LLMGW-Endpoint" not in r.headers

    # Its endpoint left the list: its responses are gone with it, the others still read back.
    other_id = next(rid for rid, (ep, _) in created.items() if ep != first_ep)
    publish(cluster, {k: v for k, v in urls.items() if k != first_ep})
    wait_until(lambda: endpoints_seen(gw) == 1, 10, what="the shorter list")
    r = requests.get(f"{gw}/v1/responses/{first_id}", timeout=5)
    assert r.status_code == 404 and "no longer serving" in r.json()["error"]["message"]
    assert client.responses.retrieve(other_id).id == other_id


def test_the_rest_of_the_surface_reaches_the_sim(cluster):
    cluster.start_redis()
    publish(cluster, {"sim-a": start_sim(cluster, "sim-a")})
    gw = cluster.start_gateway(**FAST)
    wait_until(lambda: endpoints_seen(gw) == 1, 10, what="the endpoint")
    r = requests.post(gw + "/v1/rerank", json={"model": "m", "query": "red fox", "documents": ["a cat", "the red fox"]},
                      timeout=10).json()
    assert [x["index"] for x in r["results"]] == [1, 0]
    r = requests.post(gw + "/v1/score", json={"model": "m", "text_1": "red fox", "text_2": ["red fox"]}, timeout=10)
    assert r.json()["data"][0]["score"] == 1.0
    tokens = requests.post(gw + "/v1/tokenize", json={"model": "m-alias", "prompt": "hello world"}, timeout=10).json()
    assert tokens["count"] == 3  # served at the engine's /tokenize
    text = requests.post(gw + "/v1/detokenize", json={"model": "m", "tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": "hello world"}
    client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0, timeout=30)
    heard = client.audio.transcriptions.create(model="m", file=("a.wav", b"RIFF" + b"\0" * 2000, "audio/wav"))
    assert heard.text == "the simulated engine heard this audio"
    r = requests.post(gw + "/v1/embeddings", json={"model": "m", "input": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_endpoint"
    card = requests.get(gw + "/v1/models", timeout=5).json()["data"][0]
    assert card["id"] == "m" and card["engines"] == ["sim"] and card["ready_replicas"] == 1
