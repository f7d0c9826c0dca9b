"""`GET /v1/models/{id}` through the gateway (gunicorn, the gevent worker) with the official `openai`
client: every name and alias `GET /v1/models` lists is retrieved as it is listed (a model, its aliases,
a name with a slash, a model scaled to zero, a LoRA adapter and its alias); a name it does not list,
or one the key may not call, is the SDK's NotFoundError with an OpenAI-shaped body."""

from __future__ import annotations

import time

import openai
import pytest
import requests

from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.state.records import EndpointInfo
from harness.procs import wait_until

CATALOG = parse_catalog({"models": [
    {"name": "org/m", "aliases": ["m-alias"],
     "profiles": [{"name": "cpu", "engine": "sim", "replicas": 1, "lora": {"max_loras": 2}}],
     "adapters": [{"name": "a1", "aliases": ["x1"], "source": "/ad/a1", "rank": 8}]},
    {"name": "cold", "aliases": ["cold-alias"],
     "profiles": [{"name": "cpu", "engine": "sim", "autoscale": {"min": 0, "max": 1}}]},
    {"name": "waiting", "profiles": [{"name": "cpu", "engine": "sim", "replicas": 1}]},
]})
FAST = {"LLMGW_GATEWAY_POLL_INTERVAL": "0.2"}


@pytest.fixture
def gw(cluster):
    cluster.start_redis()
    store = cluster.store()
    apply_catalog(store, CATALOG, source="t", applied_by="t")
    # Nothing needs to answer: the gateway lists what is published.
    ep = EndpointInfo(id="e1", url="http://127.0.0.1:9", models=("org/m", "m-alias"), engine="sim", model="org/m",
                      served_name="org/m", capacity=4, profile="cpu", adapters=("a1",), adapter_slots=2)
    store.write_endpoints([ep], "fp", time.time())
    url = cluster.start_gateway(**FAST)
    wait_until(lambda: requests.get(url + "/healthz", timeout=5).json()["endpoints"] == 1, 10, what="the endpoint")
    return store, url


def test_every_listed_name_and_alias_is_retrieved_as_listed(gw):
    _, url = gw
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert {"org/m", "m-alias", "cold", "cold-alias", "a1"} <= set(listed), listed
    aliases = {a for card in listed.values() for a in card["aliases"]}
    assert "x1" in aliases and "x1" not in listed  # an adapter's alias is named on its card only
    for name in sorted(set(listed) | aliases):
        got = client.models.retrieve(name)
        assert got.id == name and got.object == "model", name
        if name in listed:
            assert got.model_dump() == listed[name]
    x1 = client.models.retrieve("x1").model_dump()
    assert (x1["parent"], x1["aliases"]) == ("org/m", ["a1"])
    assert client.models.retrieve("m-alias").model_dump()["aliases"] == ["org/m"]


def test_a_name_not_listed_is_not_found(gw):
    store, url = gw
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
    for name, words in (("nope", "does not exist"), ("waiting", "no Ready replica")):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(name)
        err = e.value.body
        assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error", err
        assert words in err["message"]


def test_a_key_retrieves_only_the_models_it_may_call(cluster, gw):
    store, url = gw
    _, key = store.create_key("narrow", models=("m-alias",))
    wait_until(lambda: requests.get(url + "/v1/models", timeout=5).status_code == 401, 10, what="keys in use")
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)
    assert client.models.retrieve("org/m").id == "org/m"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("a1")
    assert e.value.body["message"] == "model 'a1' does not exist"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.retrieve("org/m")
