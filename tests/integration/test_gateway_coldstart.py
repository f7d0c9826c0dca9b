"""Cold start in the gateway (fakeredis, in-process fake engines): a model scaled to zero stays listed,
a request for it is held in its queue while the control plane is told at once (a hint and a kick),
and is sent (streamed or not) as soon as a replica is published; or gets 503 with Retry-After that
says the model is starting. The queue's bound holds for cold starts too."""

from __future__ import annotations

import threading
import time

import pytest

from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.state import keys
from tests.support.gateway_app import CHAT, endpoint, make_app, server, store, wall_clock  # noqa: F401
from harness.procs import wait_until

CATALOG = parse_catalog({"models": [
    {"name": "m", "aliases": ["m-alias"], "profiles": [
        {"name": "cpu", "engine": "sim", "autoscale": {"min": 0, "max": 2, "cold_start_timeout": "2s"}}]},
    {"name": "fixed", "profiles": [{"name": "cpu", "engine": "sim", "replicas": 1}]},
]})


class Kicks:
    def __init__(self):
        self.sent: list[str] = []

    def kick(self, task: str) -> bool:
        self.sent.append(task)
        return True


@pytest.fixture
def cold(store):
    apply_catalog(store, CATALOG, source="t", applied_by="t", now=0)
    _, gw, c = make_app(store, [], clock=wall_clock(), queue_max=2)
    kicks = Kicks()
    gw.demand._kicker = lambda: kicks
    return gw, c, kicks


def test_a_model_at_zero_stays_listed_and_the_fixed_one_does_not_cold_start(cold):
    gw, c, _ = cold
    ids = {m["id"] for m in c.get("/v1/models").json["data"]}
    assert {"m", "m-alias"} <= ids and "fixed" not in ids
    r = c.post(CHAT, json={"model": "fixed"})
    assert r.status_code == 503 and r.json["error"]["code"] == "no_ready_replica"


@pytest.mark.parametrize("stream", [False, True])
def test_a_held_request_is_sent_once_a_replica_is_published(cold, store, upstreams, stream):
    gw, c, kicks = cold
    up = upstreams(tokens=4)
    out = {}

    def call():
        t0 = time.monotonic()
        r = c.post(CHAT, json={"model": "m-alias", "stream": stream})
        out["r"], out["took"] = r, time.monotonic() - t0

    t = threading.Thread(target=call)
    t.start()
    # Held, and the control plane told at once: the hint names the model (not the alias).
    wait_until(lambda: kicks.sent and gw.background.report().models.get("m") and gw.background.report().models["m"].queued == 1, 2,
               interval=0.01, what="a kick and the queued request")
    assert kicks.sent == ["llmgw.reconcile"] and store.r.get(keys.demand_hint("m"))
    assert t.is_alive()
    store.write_endpoints([endpoint("m-1", up.url, models=("m", "m-alias"))], "fp", time.time())
    gw.pollers.refresh_endpoints()  # what the pub/sub hint makes the poller do
    t.join(5)
    r = out["r"]
    assert r.status_code == 200 and out["took"] < 2
    if stream:
        assert r.data.rstrip().endswith(b"data: [DONE]")
    else:
        assert r.json["usage"]["completion_tokens"] == 4


def test_no_replica_within_the_timeout_is_a_503_that_says_the_model_is_starting(cold):
    _, c, _ = cold
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json["error"]["code"] == "no_ready_replica"
    assert "is starting" in r.json["error"]["message"] and "2s" in r.json["error"]["message"]


def test_held_requests_count_against_the_queue_bound(cold):
    gw, c, _ = cold
    held = [threading.Thread(target=lambda: c.post(CHAT, json={"model": "m"})) for _ in range(2)]
    for t in held:
        t.start()
    wait_until(lambda: len(gw.queues.get("m")) == 2, 2, interval=0.01, what="two held requests")
    r = c.post(CHAT, json={"model": "m"})
    assert r.status_code == 429 and "is starting" in r.json["error"]["message"]
    for t in held:
        t.join(5)
