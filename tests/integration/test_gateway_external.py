"""The gateway's side of the wider surface on fakeredis and in-process fake engines: an external
server's key reaches that endpoint only, a missing key variable takes only its endpoint out,
operations no endpoint of the model serves get 400 unsupported_endpoint naming the models that do, a
form's model routes a transcription (renamed to the endpoint's served name), and /v1/models says what
llmgw knows."""

from __future__ import annotations

import logging
import time

import requests

from gateway.app import create_app
from gateway.config import GatewaySettings, RoutingConfig
from llmgw import surface as op
from llmgw.state.records import EndpointInfo, LoadRecord
from tests.support.gateway_app import server, store  # noqa: F401 - fixtures

CHAT = "/v1/chat/completions"
SIM_LIKE = op.same_paths(op.CHAT, op.COMPLETIONS, op.TRANSCRIPTIONS)


def endpoint(i, url, model="m", **kw):
    return EndpointInfo(id=i, url=url, models=(model, f"{model}-alias"), engine=kw.pop("engine", "external"),
                        model=model, served_name=kw.pop("served_name", model), capacity=8, profile=f"p-{i}", **kw)


def make_app(store, eps, environ=None, **cfg):
    store.write_endpoints(eps, "fp", time.time())
    app = create_app(GatewaySettings(routing=RoutingConfig(policy="round_robin"), **cfg), store=store,
                     environ=environ or {})
    app.extensions["llmgw"].refresh()
    return app, app.extensions["llmgw"], app.test_client()


def test_an_external_key_reaches_its_endpoint_only(store, upstreams):
    a, b, c = upstreams(name="a"), upstreams(name="b"), upstreams(name="c", require_key="secret-c")
    eps = [endpoint("a", a.url, api_key_env="KEY_A"), endpoint("b", b.url), endpoint("c", c.url, api_key_env="KEY_C")]
    _, gw, client = make_app(store, eps, {"KEY_A": "secret-a", "KEY_C": "secret-c", "OTHER": "x"})
    _, user_key = store.create_key("team")
    gw.refresh()
    for _ in range(9):
        r = client.post(CHAT, json={"model": "m"}, headers={"Authorization": f"Bearer {user_key}"})
        assert r.status_code == 200, r.json
    seen = {u.name: set(u.stats["authorization"]) for u in (a, b, c)}
    assert seen == {"a": {"Bearer secret-a"}, "b": {None}, "c": {"Bearer secret-c"}}
    assert all(len(u.stats["authorization"]) == 3 for u in (a, b, c))


def test_a_missing_key_variable_takes_only_its_endpoint_out(store, upstreams, caplog):
    a, b = upstreams(name="a"), upstreams(name="b")
    eps = [endpoint("a", a.url, api_key_env="LEGACY_KEY"), endpoint("b", b.url),
           endpoint("x", a.url, model="lonely", api_key_env="LEGACY_KEY")]
    with caplog.at_level(logging.WARNING, logger="llmgw.gateway"):
        _, gw, client = make_app(store, eps, {})
        gw.pollers.refresh_endpoints(force=True)
    warnings = [r.getMessage() for r in caplog.records if "LEGACY_KEY" in r.getMessage()]
    assert len(warnings) == 2 and any("m/p-a" in w for w in warnings) and any("lonely/p-x" in w for w in warnings)
    for _ in range(4):
        r = client.post(CHAT, json={"model": "m"})
        assert r.status_code == 200 and r.headers["X-LLMGW-Endpoint"] == "b"
    r = client.post(CHAT, json={"model": "lonely"})
    assert r.status_code == 503 and r.json["error"]["code"] == "no_ready_replica"
    assert "LEGACY_KEY" in r.json["error"]["message"] and r.headers["Retry-After"] == "1"
    assert a.stats["requests"] == 0
    assert client.get("/healthz").json["missing_key_variables"] == ["LEGACY_KEY"]


def test_an_operation_no_endpoint_serves_is_a_clear_400_naming_what_would(store, upstreams):
    u = upstreams()
    _, _, client = make_app(store, [endpoint("e", u.url, engine="sim", paths=SIM_LIKE),
                                    endpoint("old", u.url, model="legacy", engine="vllm")])
    r = client.post("/v1/embeddings", json={"model": "m", "input": "x"})
    assert r.status_code == 400 and r.json["error"]["code"] == "unsupported_endpoint"
    assert r.json["error"]["message"] == ("no endpoint of model 'm' serves POST /v1/embeddings: its endpoints (sim) "
                                          "do not serve it; model that serves it: legacy")
    r = client.post("/v1/tokenize", json={"model": "legacy", "prompt": "x"})  # published without a map
    assert r.status_code == 400 and r.json["error"]["code"] == "unsupported_endpoint"
    assert r.json["error"]["message"].endswith("; no model here serves it now")
    assert client.post("/v1/embeddings", json={"model": "legacy", "input": "x"}).status_code == 200
    r = client.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": []})
    assert r.status_code == 404 and r.json["error"]["code"] == "model_not_found"
    assert client.get("/v1/rerank").status_code == 405
    assert u.stats["requests"] == 1


def test_a_transcription_is_routed_by_its_form_model_under_the_served_name(store, upstreams):
    w, m = upstreams(name="whisper"), upstreams(name="chat")
    _, _, client = make_app(store, [endpoint("w", w.url, model="whisper", served_name="openai/whisper-x",
                                             engine="sim", paths=SIM_LIKE),
                                    endpoint("m", m.url, engine="sim", paths=SIM_LIKE)])
    audio = b"RIFF" + bytes(range(256)) * 8
    req = requests.Request("POST", "http://x/v1/audio/transcriptions", data={"model": "whisper-alias"},
                           files={"file": ("a.wav", audio, "audio/wav")}).prepare()
    r = client.post("/v1/audio/transcriptions", data=req.body, content_type=req.headers["Content-Type"])
    assert r.status_code == 200 and r.json == {"text": "heard by whisper"}
    assert r.headers["X-LLMGW-Endpoint"] == "w" and w.stats["models_seen"] == ["openai/whisper-x"]
    assert m.stats["requests"] == 0
    bad = client.post("/v1/audio/transcriptions", data=b"x", content_type="multipart/form-data; boundary=zz")
    assert bad.status_code == 400 and bad.json["error"]["code"] == "invalid_request"
    none = requests.Request("POST", "http://x/", files={"file": ("a.wav", audio, "audio/wav")}).prepare()
    r = client.post("/v1/audio/transcriptions", data=none.body, content_type=none.headers["Content-Type"])
    assert r.status_code == 400 and r.json["error"]["code"] == "model_required"
    big = requests.Request("POST", "http://x/", data={"model": "whisper"},
                           files={"file": ("a.wav", b"x" * 5000, "audio/wav")}).prepare()
    _, _, small = make_app(store, [endpoint("w", w.url, model="whisper", engine="sim", paths=SIM_LIKE)],
                           max_body_bytes=4096)
    r = small.post("/v1/audio/transcriptions", data=big.body, content_type=big.headers["Content-Type"])
    assert r.status_code == 413 and r.json["error"]["code"] == "request_too_large"


def test_models_carry_openai_fields_and_what_llmgw_knows(store, upstreams):
    u = upstreams()
    eps = [endpoint("a", u.url, engine="vllm"), endpoint("b", u.url, engine="external"),
           endpoint("c", u.url, model="solo", engine="sim", api_key_env="NOT_SET")]
    store.write_load(LoadRecord("a", time.time(), True, context_length=8192))
    store.write_load(LoadRecord("b", time.time(), True, context_length=32768))
    _, _, client = make_app(store, eps)
    cards = {c["id"]: c for c in client.get("/v1/models").json["data"]}
    assert set(cards) == {"m", "m-alias"}  # solo's only endpoint cannot be sent to here
    assert cards["m"] == {"id": "m", "object": "model", "created": 0, "owned_by": "llmgw", "aliases": ["m-alias"],
                          "engines": ["external", "vllm"], "ready_replicas": 2, "context_length": 8192}
    assert cards["m-alias"]["aliases"] == ["m"]
