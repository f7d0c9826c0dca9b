"""The console's API (/ui/api/...) and page on fakeredis: who may read it, what each answer holds, bad
parameters, a Redis outage, and a page that loads nothing from elsewhere."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
import redis

from gateway.app import create_app
from gateway.config import GatewaySettings
from gateway.observe.traffic import SLOT, slot_of
from llmgw.catalog import apply_catalog
from llmgw.state import events, keys
from llmgw.state.keypolicy import new_key
from llmgw.state.demand_records import EndpointUse, GatewayReport, ModelDemand
from llmgw.state.records import LoadRecord
from tests.support.clock import FakeClock
from tests.unit.control_support import catalog, cpu_profile, gpu_profile, model, node
from workers.control.apply import reconcile_once
from workers.control.publish_pass import publish_once

STATIC = Path(__file__).resolve().parents[2] / "gateway" / "ui" / "static"


class NullDispatcher:
    def launch(self, *a):
        pass

    def stop(self, *a):
        pass


@pytest.fixture
def fleet(store):
    """Two models: `chat` with one Ready CPU replica (load, gateway demand, traffic) and `big` Pending."""
    now = time.time()
    apply_catalog(store, catalog(model("chat", cpu_profile(), aliases=["c"]), model("big", gpu_profile(count=2))),
                  source="chat.yaml", applied_by="alice")
    store.write_heartbeat(node("a", "h100:1"), ttl=60)
    reconcile_once(store, NullDispatcher(), lambda: now)
    chat = next(r for r in store.all_replicas() if r.model == "chat")
    store.update_replica(chat.id, started_at=now, first_ready_at=now, last_probe_ok=True, url="http://a:1")
    publish_once(store, lambda: now)
    store.write_load(LoadRecord(chat.id, ts=now, ok=True, running=2, waiting=1, kv_usage=0.5))
    store.write_gateway_report(GatewayReport("g:1", at=now, endpoints={chat.id: EndpointUse(3)},
                                             models={"chat": ModelDemand(3, 1, now)}), ttl=60)
    store.add_traffic({slot_of(now) - 1: {"chat:n": 10, "chat:lat30": 10}}, ttl=600)
    return chat


def client(store, **cfg):
    app = create_app(GatewaySettings(**cfg), store=store, clock=FakeClock(time.time()))
    gw = app.extensions["llmgw"]
    gw.refresh()
    return gw, app.test_client()


def test_the_page_and_its_files_load_nothing_from_elsewhere(store):
    _, c = client(store)
    for path in ("/ui", "/ui/", "/ui/static/console.js", "/ui/static/console.css"):
        assert c.get(path).status_code == 200, path
    page = c.get("/ui").get_data(as_text=True)
    assert 'src="/ui/static/console.js"' in page
    for f in STATIC.iterdir():
        text = f.read_text()
        # No CDN, no font or script from another host: the only URL is the SVG namespace name.
        assert re.findall(r"https?://[^\s\"'`)]+", text) in ([], ["http://www.w3.org/2000/svg"]), f.name


def test_the_front_page_sends_a_browser_to_the_console_and_an_api_client_gets_json(store):
    _, c = client(store)
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"  # Firefox's and Chrome's
    r = c.get("/", headers={"Accept": browser})
    assert r.status_code == 302 and r.headers["Location"] == "/ui"
    assert c.get("/", headers={"Accept": browser}, follow_redirects=True).get_data(as_text=True).count(
        "console.js") == 1
    for accept in (None, "*/*", "application/json"):  # requests, curl, an SDK
        r = c.get("/", headers={"Accept": accept} if accept else {})
        assert r.status_code == 200 and r.json["console"] == "/ui" and r.json["models"] == "/v1/models", accept
    # Any other unknown path is still the gateway's JSON 404.
    r = c.get("/nope", headers={"Accept": browser})
    assert r.status_code == 404 and r.json["error"]["code"] == "not_found"


def test_open_without_keys_and_admin_only_once_keys_exist(store, fleet):
    _, c = client(store)
    assert c.get("/ui/api/fleet").status_code == 200  # auth auto, no key yet: open
    _, ordinary = store.create_key("app")
    rec, admin = new_key("ops", None, None, None, time.time())
    store.r.hset(keys.API_KEYS, rec.id, dataclasses.replace(rec, admin=True).to_json())
    gw, c = client(store)
    assert gw.keys.required
    r = c.get("/ui/api/fleet")
    assert r.status_code == 401 and r.json["error"]["code"] == "invalid_api_key"
    r = c.get("/ui/api/fleet", headers={"Authorization": f"Bearer {ordinary}"})
    assert r.status_code == 403 and r.json["error"]["code"] == "admin_key_required"
    assert "'app' is not an admin key" in r.json["error"]["message"]
    for path in ("/ui/api/models", "/ui/api/events", "/ui/api/catalog"):
        assert c.get(path, headers={"Authorization": f"Bearer {ordinary}"}).status_code == 403, path
        assert c.get(path, headers={"Authorization": f"Bearer {admin}"}).status_code == 200, path
    assert c.get("/ui").status_code == 200  # the page itself holds no data: it asks for the key
    # With auth off the gateway is open, and so is its console (docs/console.md).
    _, c = client(store, auth="off")
    assert c.get("/ui/api/fleet").status_code == 200


def test_fleet_is_llmgw_status(store, fleet):
    _, c = client(store)
    r = c.get("/ui/api/fleet")
    assert r.headers["Cache-Control"] == "no-store"
    body = r.json
    assert set(body) >= {"nodes", "replicas", "replica_states", "endpoints", "catalog"}
    (a,) = body["nodes"]
    assert a["name"] == "a" and a["live"] and a["devices"] == [{"index": 0, "class": "h100", "replica": None,
                                                               "model": None, "healthy": True, "health": ""}]
    assert {r["model"]: r["state"] for r in body["replicas"]} == {"chat": "Ready", "big": "Pending"}


def test_models_has_wanted_ready_load_and_traffic(store, fleet):
    gw, c = client(store)
    body = c.get("/ui/api/models").json
    chat, big = (next(m for m in body["models"] if m["name"] == n) for n in ("chat", "big"))
    assert (chat["wanted"], chat["ready"], chat["aliases"]) == (1, 1, ["c"])
    assert chat["gateway"] == {"inflight": 3, "queued": 1, "processes": 1}
    (row,) = chat["profiles"][0]["replicas"]
    assert row["id"] == fleet.id and row["state"] == "Ready"
    assert row["load"] == {"inflight": 3, "running": 2, "waiting": 1, "kv": 0.5, "load_error": None,
                           "service_time": None, "prefix": None}
    assert chat["profiles"][0]["capacity"] == 16
    last = chat["traffic"][-1]
    assert last["rps"] == 10 / SLOT and last["p50"] is not None
    assert (big["wanted"], big["ready"]) == (1, 0) and big["profiles"][0]["replicas"][0]["state"] == "Pending"
    assert body["thresholds"] == {"max_waiting": gw.cfg.routing.max_waiting, "max_kv": gw.cfg.routing.max_kv}
    assert chat["tenants"] == [] and big["tenants"] == []


def test_models_show_each_key_s_weight_service_share_and_wait(store, fleet):
    from llmgw.state.tenants import TenantDelta

    kid, _ = store.create_key("team-a", weight=2.0)
    store.add_tenants({("chat", kid): TenantDelta(100.0, 200.0, 3.0, 4)}, int(time.time() // 60))
    _, admin = store.create_key("ops", admin=True)
    _, c = client(store)
    body = c.get("/ui/api/models", headers={"Authorization": f"Bearer {admin}"}).json
    chat = next(m for m in body["models"] if m["name"] == "chat")
    assert chat["tenants"] == [{"key": "team-a", "id": kid, "weight": 2.0, "service_tokens": 200, "requests": 4,
                                "mean_wait": 0.75, "share": 1.0}]


def test_events_filter_and_page_with_a_cursor(store, fleet):
    _, c = client(store)
    body = c.get("/ui/api/events?kind=replica_*&model=chat").json
    assert [e["kind"] for e in body["events"]] == ["replica_placed"]
    cursor = body["cursor"]
    assert c.get(f"/ui/api/events?after={cursor}").json["events"] == []
    store.emit("replica_failed", "attempt 1 killed by SIGKILL", model="chat", node="a")
    store.emit("node_cordoned", "llmgw node cordon", node="a")
    newer = c.get(f"/ui/api/events?after={cursor}&model=chat").json
    assert [e["kind"] for e in newer["events"]] == ["replica_failed"] and newer["cursor"] != cursor
    for query, message in (("kind=replica_exploded", "kind: no event kind 'replica_exploded'"),
                           ("after=yesterday", "after: expected an event id"),
                           ("limit=many", "limit: expected an integer")):
        r = c.get(f"/ui/api/events?{query}")
        assert r.status_code == 400 and r.json["error"]["message"].startswith(message), query


def test_catalog_has_yaml_and_history_with_who_applied(store, fleet):
    apply_catalog(store, catalog(model("chat", cpu_profile(replicas=2))), source="v2.yaml", applied_by="bob")
    _, c = client(store)
    body = c.get("/ui/api/catalog").json
    assert (body["version"], body["applied_by"], body["source"]) == (2, "bob", "v2.yaml")
    assert "name: chat" in body["yaml"] and "replicas: 2" in body["yaml"] and "big" not in body["yaml"]
    assert "null" not in body["yaml"] and "start_timeout" not in body["yaml"]  # `catalog show -o yaml`'s form
    assert [(h["version"], h["applied_by"]) for h in body["history"]] == [(2, "bob"), (1, "alice")]
    old = c.get("/ui/api/catalog?version=1").json
    assert old["version"] == 1 and "name: big" in old["yaml"]
    assert c.get("/ui/api/catalog?version=9").status_code == 404
    assert c.get("/ui/api/catalog?version=x").status_code == 400


def test_a_redis_outage_is_a_clear_503(store, fleet):
    _, c = client(store)

    def down(*a, **kw):
        raise redis.ConnectionError("Connection refused")

    store.r.get = down
    r = c.get("/ui/api/catalog")
    assert r.status_code == 503 and "cannot read Redis" in r.json["error"]["message"]


def test_fleet_metrics_are_the_control_planes_facts(store, fleet):
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.observe.fleetmetrics import FAMILIES

    store.write_heartbeat(node("gone"), ttl=60)
    store.r.delete(keys.node_heartbeat("gone"))
    store.set_node_admin("a", cordoned=True)
    _, c = client(store)
    r = c.get("/metrics/fleet")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(r.get_data(as_text=True)) for s in f.samples}

    def v(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert v("llmgw_fleet_replicas", model="chat", profile="cpu", state="Ready") == 1
    assert v("llmgw_fleet_replicas", model="big", profile="gpu", state="Pending") == 1
    assert v("llmgw_fleet_replicas_wanted", model="big", profile="gpu") == 1
    assert v("llmgw_fleet_pending_replicas") == 1
    assert v("llmgw_fleet_replica_restarts", model="chat", profile="cpu") == 0
    assert (v("llmgw_fleet_nodes", state="live"), v("llmgw_fleet_nodes", state="lost")) == (1, 1)
    assert v("llmgw_fleet_nodes_unschedulable", reason="cordoned") == 1
    assert (v("llmgw_fleet_gpus", gpu_class="h100", state="free"), v("llmgw_fleet_gpus", gpu_class="h100", state="used")) == (1, 0)
    assert (v("llmgw_fleet_endpoints"), v("llmgw_fleet_endpoints_version"), v("llmgw_fleet_catalog_version")) == (1, 1, 1)
    assert v("llmgw_control_passes_total", task="reconcile") == 1 and v("llmgw_control_passes_total", task="publish") == 1
    assert v("llmgw_control_actions_total", task="reconcile") == 2  # two replicas created
    assert v("llmgw_control_pass_seconds_total", task="reconcile") >= 0
    exposed = {name for name, _labels in samples}
    from gateway.observe import batchmetrics

    families = {**FAMILIES, **batchmetrics.FAMILIES}  # the Batch API's come on the same page
    declared = {n + ("_total" if families[n][0] == "counter" else "") for n in families}
    assert exposed == declared


def test_a_replicas_load_shows_the_prefix_hits_expected_and_measured():
    from gateway.ui.views import replica_load
    from llmgw.state.demand_records import EndpointUse, GatewayReport
    from llmgw.state.records import LoadRecord

    gws = [GatewayReport("g:1", at=1.0, endpoints={"r": EndpointUse(1, 1.0, None, (1000.0, 400.0, 0.0, 0.0))})]
    load = LoadRecord("r", ts=1.0, ok=True, prefix_queries_total=200.0, prefix_hits_total=50.0)
    assert replica_load("r", gws, load, None, 2.0)["prefix"] == {"expected": 0.4, "measured": 0.25, "indexed": 32768,
                                                                  "indexed_by": "the default"}
    assert replica_load("r", [], None, None, 2.0)["prefix"] is None
    # what the gateways' index of it is sized to: the engine's figure, unless the catalog says one
    sized = LoadRecord("r", ts=1.0, ok=True, prefix_queries_total=200.0, prefix_hits_total=50.0, kv_tokens=24576)
    assert replica_load("r", gws, sized, None, 2.0)["prefix"]["indexed"] == 24576
    assert replica_load("r", gws, sized, None, 2.0, 8192)["prefix"]["indexed_by"] == "the catalog's kv_cache_tokens"
