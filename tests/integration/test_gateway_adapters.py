"""LoRA adapters in the gateway (fakeredis, in-process fake engines): a request for an adapter (or an
alias) goes only to the endpoints holding it, under the adapter's served name; one no endpoint holds
waits for a load while a replica serves it (the control plane told at once) and is sent once a
holder is published, or is refused with the reason; `/v1/models` lists adapters with their
`parent`; a key's `--models` names adapters like models."""

from __future__ import annotations

import threading
import time

import pytest

from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.state import keys
from tests.support.gateway_app import CHAT, endpoint, make_app, server, store, wall_clock  # noqa: F401
from harness.procs import wait_until

CATALOG = parse_catalog({"models": [
    {"name": "m", "aliases": ["m-alias"],
     "profiles": [{"name": "cpu", "engine": "sim", "replicas": 2, "lora": {"max_loras": 2}}],
     "adapters": [{"name": "a1", "aliases": ["x1"], "source": "/ad/a1", "rank": 8},
                  {"name": "a2", "source": "/ad/a2", "rank": 8},
                  {"name": "a3", "source": "/ad/a3", "rank": 8, "replicas": 0}]},
    {"name": "other", "profiles": [{"name": "cpu", "engine": "sim", "replicas": 1, "lora": {}}],
     "adapters": [{"name": "b1", "source": "/ad/b1", "rank": 8}]},
]})


class Kicks:
    def __init__(self):
        self.sent: list[str] = []

    def kick(self, task: str) -> bool:
        self.sent.append(task)
        return True


def ep(i, url, adapters=(), **kw):
    return endpoint(i, url, profile="cpu", adapters=tuple(adapters), adapter_slots=2, **kw)


@pytest.fixture
def gw(store, upstreams):
    apply_catalog(store, CATALOG, source="t", applied_by="t", now=0)
    up1, up2 = upstreams(name="e1"), upstreams(name="e2")
    _, gw, c = make_app(store, [ep("e1", up1.url, ["a1"]), ep("e2", up2.url, ["a2"])], clock=wall_clock(),
                        queue_max=4)
    kicks = Kicks()
    gw.demand._kicker = lambda: kicks
    return gw, c, up1, up2, kicks


def test_an_adapter_goes_only_to_its_holders_under_its_name(gw):
    _, c, up1, up2, _ = gw
    for name in ("a1", "x1", "a1", "x1"):
        r = c.post(CHAT, json={"model": name})
        assert r.status_code == 200 and r.headers["X-LLMGW-Endpoint"] == "e1", r.json
        assert r.json["model"] == name  # the engine answered "a1": the client hears the name it sent
    assert up1.stats["models_seen"] == ["a1"] * 4  # the adapter's served name, also for its alias
    assert c.post(CHAT, json={"model": "a2"}).headers["X-LLMGW-Endpoint"] == "e2"
    assert up2.stats["models_seen"] == ["a2"]
    seen = {c.post(CHAT, json={"model": "m"}).headers["X-LLMGW-Endpoint"] for _ in range(8)}
    assert seen == {"e1", "e2"}  # the base model anywhere, under its served name
    assert set(up1.stats["models_seen"][4:]) <= {"served-m"}


def test_an_adapter_no_endpoint_holds_waits_for_a_load_and_is_sent_to_the_new_holder(gw, store):
    g, c, up1, _, kicks = gw
    out = {}
    t = threading.Thread(target=lambda: out.update(r=c.post(CHAT, json={"model": "a3"})))
    t.start()
    wait_until(lambda: kicks.sent and g.background.report().models.get("a3"), 2, interval=0.01,
               what="the control plane told and the request queued under the adapter's name")
    assert store.r.get(keys.demand_hint("a3")) and t.is_alive()
    store.write_endpoints([ep("e1", up1.url, ["a1", "a3"])], "fp2", time.time())
    g.pollers.refresh_endpoints()
    t.join(5)
    assert out["r"].status_code == 200 and out["r"].headers["X-LLMGW-Endpoint"] == "e1"
    assert up1.stats["models_seen"][-1] == "a3"


def test_an_adapter_nothing_can_load_is_refused_with_the_reason(gw, store, upstreams):
    _, c, _, _, _ = gw
    r = c.post(CHAT, json={"model": "b1"})  # no endpoint of model `other` is published
    assert r.status_code == 503, r.json
    assert r.json["error"]["message"] == ("adapter 'b1' cannot be served now: no replica of model 'other' that "
                                          "serves adapter 'b1' is Ready, so none can load it")
    assert c.post(CHAT, json={"model": "nope"}).status_code == 404


def test_models_lists_adapters_with_their_parent(gw):
    _, c, _, _, _ = gw
    cards = {m["id"]: m for m in c.get("/v1/models").json["data"]}
    assert (cards["a1"]["parent"], cards["a1"]["aliases"], cards["a1"]["ready_replicas"]) == ("m", ["x1"], 1)
    assert (cards["a3"]["parent"], cards["a3"]["ready_replicas"]) == ("m", 0)  # loadable on demand
    assert "b1" not in cards  # nothing serves it


def test_a_keys_models_name_adapters(gw, store):
    g, c, _, _, _ = gw
    _, key = store.create_key("narrow", models=("x1",))  # an alias names the adapter
    g.keys.refresh()
    auth = {"Authorization": f"Bearer {key}"}
    assert c.post(CHAT, json={"model": "a1"}, headers=auth).status_code == 200
    assert c.post(CHAT, json={"model": "a2"}, headers=auth).status_code == 404
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 404
    assert sorted(m["id"] for m in c.get("/v1/models", headers=auth).json["data"]) == ["a1"]


def test_an_adapter_whose_only_holder_died_waits_for_a_load_elsewhere(gw, store, upstreams):
    """The holder was killed and is still listed: the request fails on it, then waits (not a 503) and
    is sent to the replica the adapter is loaded on next."""
    g, c, _, up2, kicks = gw
    dead = upstreams(name="dead")
    store.write_endpoints([ep("e1", dead.url, ["a1"]), ep("e2", up2.url, ["a2"])], "fp-dead", time.time())
    g.pollers.refresh_endpoints()
    dead.stop()  # kill -9: connections refused from now on
    out = {}
    t = threading.Thread(target=lambda: out.update(r=c.post(CHAT, json={"model": "a1"})))
    t.start()
    wait_until(lambda: kicks.sent, 5, interval=0.01, what="the control plane told of the request held for a1")
    assert t.is_alive()  # still waiting
    store.write_endpoints([ep("e1", dead.url, ["a1"]), ep("e2", up2.url, ["a2", "a1"])], "fp-loaded", time.time())
    g.pollers.refresh_endpoints()
    t.join(5)
    assert out["r"].status_code == 200 and out["r"].headers["X-LLMGW-Endpoint"] == "e2", out["r"].json


def test_an_adapter_whose_only_holder_died_waits_for_the_holder_to_come_back(gw, store, upstreams):
    g, c, _, up2, _ = gw
    dead = upstreams(name="dead")
    store.write_endpoints([ep("e1", dead.url, ["a1"]), ep("e2", up2.url, ["a2"])], "fp-dead", time.time())
    g.pollers.refresh_endpoints()
    dead.stop()
    out = {}
    t = threading.Thread(target=lambda: out.update(r=c.post(CHAT, json={"model": "a1"})))
    t.start()
    wait_until(lambda: g.background.report().models.get("a1"), 5, interval=0.01, what="the request held for a1")
    # The agent sees the engine exit (unpublished), restarts it on a new port, it loads a1 again.
    store.write_endpoints([ep("e2", up2.url, ["a2"])], "fp-gone", time.time())
    g.pollers.refresh_endpoints()
    back = upstreams(name="back")
    store.write_endpoints([ep("e1", back.url, ["a1"]), ep("e2", up2.url, ["a2"])], "fp-back", time.time())
    g.pollers.refresh_endpoints()
    t.join(30)  # a wait for the answer, not a time it must take (a loaded machine takes seconds)
    assert "r" in out, "the held request never ended"
    assert out["r"].status_code == 200 and out["r"].headers["X-LLMGW-Endpoint"] == "e1", out["r"].json
    assert back.stats["models_seen"] == ["a1"]
