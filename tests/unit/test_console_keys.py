"""The console's keys page API (/ui/api/keys) on fakeredis: the first key made from a gateway with none,
an admin's create, change and revoke through `llmgw keys`' code path, each an event naming the admin
key; bad fields named; and the CLI writing the same events. Then `GET /v1/llmgw/requests/{id}`: how an
explained request was served, readable by its own key or an admin only."""

from __future__ import annotations

import json
import time

import fakeredis
import pytest

from gateway.app import create_app
from gateway.config import GatewaySettings
from llmgw.catalog import apply_catalog
from llmgw.state.keypolicy import key_changes
from llmgw.state.store import Store
from tests.support.clock import FakeClock
from tests.support.gateway_app import CHAT, endpoint
from tests.unit.control_support import catalog, cpu_profile, model


@pytest.fixture
def store():
    return Store(fakeredis.FakeRedis(decode_responses=True))


def client(store, **cfg):
    app = create_app(GatewaySettings(**cfg), store=store, clock=FakeClock(time.time()))
    gw = app.extensions["llmgw"]
    gw.refresh()
    return gw, app.test_client()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def key_events(store) -> list:
    return [e for e in store.latest_events(100) if e.kind.startswith("key_")]


def test_the_first_key_from_a_gateway_with_none_is_an_admin_key_and_closes_the_door(store):
    gw, c = client(store)
    r = c.get("/ui/api/keys")
    assert r.status_code == 200 and r.json["bootstrap"] is True and r.json["keys"] == []
    made = c.post("/ui/api/keys", json={"name": "ops", "admin": False})  # made admin whatever it asks
    assert made.status_code == 201 and made.json["key"].startswith("sk-llmgw-")
    assert made.json["record"]["admin"] is True and "hash" not in made.json["record"]
    assert gw.keys.required  # this process applied it at once
    [ev] = key_events(store)
    assert ev.kind == "key_created" and ev.source == "console" and "first key" in ev.data["by"]
    assert made.json["key"] not in json.dumps(ev.to_dict())  # never the secret in the history
    again = c.post("/ui/api/keys", json={"name": "sneaky"})
    assert again.status_code == 401
    assert c.get("/ui/api/keys").status_code == 401


def test_an_admin_creates_changes_and_revokes_through_the_clis_code_path(store):
    apply_catalog(store, catalog(model("m", cpu_profile())), source="m.yaml", applied_by="alice")
    _, admin = store.create_key("ops", admin=True, by="alice@host")
    _, ordinary = store.create_key("app")
    gw, c = client(store)
    assert c.get("/ui/api/keys", headers=bearer(ordinary)).status_code == 403
    made = c.post("/ui/api/keys", headers=bearer(admin), json={
        "name": "team", "models": "m,nope", "expires": "30d", "budget": "5M", "budget_period": "day", "rpm": 100,
        "weight": "2", "batches": False})
    assert made.status_code == 201, made.json
    rec = made.json["record"]
    assert rec["models"] == ["m", "nope"] and rec["budget"] == 5_000_000 and rec["budget_period"] == "day"
    assert rec["rpm"] == 100 and rec["weight"] == 2 and rec["batches"] is False and rec["expires_at"] > time.time()
    assert made.json["note"] == "nope not in the applied catalog (yet); requests for it answer 404 until it is"
    listed = c.get("/ui/api/keys", headers=bearer(admin)).json
    assert listed["bootstrap"] is False and [k["name"] for k in listed["keys"]] == ["app", "ops", "team"]
    assert "models m,nope" in next(k for k in listed["keys"] if k["name"] == "team")["describe"]
    # A change, as `llmgw keys update team --rpm none --models all --no-batches` would make it.
    changed = c.patch("/ui/api/keys/team", headers=bearer(admin), json={"rpm": "none", "models": "all",
                                                                        "admin": True})
    assert changed.status_code == 200 and changed.json["record"]["rpm"] is None
    assert changed.json["record"]["models"] == [] and changed.json["record"]["admin"] is True
    team = c.post(CHAT, json={"model": "m"}, headers=bearer(made.json["key"]))
    assert team.status_code != 401  # the gateway that made it takes it at once
    gone = c.delete("/ui/api/keys/team", headers=bearer(admin))
    assert gone.status_code == 200 and gone.json["revoked"] == rec["id"]
    assert c.post(CHAT, json={"model": "m"}, headers=bearer(made.json["key"])).status_code == 401
    evs = key_events(store)
    assert [e.kind for e in evs] == ["key_created", "key_created", "key_created", "key_updated", "key_revoked"]
    assert evs[0].data["by"] == "alice@host" and evs[0].source == "cli"
    for e in evs[2:]:
        assert e.source == "console" and e.data["by"].startswith("admin key 'ops'") and e.data["key"] == "team"
    assert evs[3].data["changed"] == ["admin", "models", "rpm"] and "changed by admin key 'ops'" in evs[3].message


@pytest.mark.parametrize("method, path, body, status, words", [
    ("post", "/ui/api/keys", {"name": "x", "rpm": "lots"}, 400, "--rpm: expected an integer, got 'lots'"),
    ("post", "/ui/api/keys", {"name": "x", "expires": "yesterday"}, 400, "--expires: expected a duration"),
    ("post", "/ui/api/keys", {"name": "x", "weight": "0"}, 400, "--weight: must be between"),
    ("post", "/ui/api/keys", {"name": "x", "admin": "yes"}, 400, "--admin: expected true or false"),
    ("post", "/ui/api/keys", {"name": "x", "colour": "red"}, 400, "unknown field 'colour'"),
    ("post", "/ui/api/keys", {"rpm": "1"}, 400, "name: required"),
    ("post", "/ui/api/keys", {"name": "ops"}, 400, "a key named 'ops' already exists"),
    ("post", "/ui/api/keys", ["x"], 400, "expected a JSON object"),
    ("patch", "/ui/api/keys/ops", {}, 400, "nothing to change"),
    ("patch", "/ui/api/keys/ops", {"name": "new"}, 400, "unknown field 'name'"),
    ("patch", "/ui/api/keys/ghost", {"rpm": "1"}, 404, "no API key named 'ghost'"),
    ("patch", "/ui/api/keys/ops", {"budget_period": "day"}, 400, "--budget-period: the key has no --budget"),
    ("delete", "/ui/api/keys/ghost", None, 404, "no API key named 'ghost'"),
])
def test_bad_input_is_one_clear_error_and_changes_nothing(store, method, path, body, status, words):
    _, admin = store.create_key("ops", admin=True)
    _, c = client(store)
    before = store.api_key_table()
    r = getattr(c, method)(path, headers=bearer(admin), json=body)
    assert r.status_code == status and words in r.json["error"]["message"], r.json
    assert store.api_key_table() == before


def test_the_cli_reads_its_flags_the_way_the_console_does():
    """`llmgw keys create|update` hands argparse's values to the same `key_changes` as the console."""
    flags = {"rpm": "10", "tpm": None, "priority": "none", "models": "a, b", "expires": "never", "budget": "250k",
             "budget_period": None, "admin": None, "batches": False, "weight": "0.5", "sub_tenants": None,
             "name": "ignored", "func": print}
    assert key_changes(flags, 0.0) == {"rpm": 10, "priority": None, "models": ("a", "b"), "expires_at": None,
                                       "budget": 250_000, "batches": False, "weight": 0.5}
    assert key_changes({"models": ["a"], "rpm": 5}, 0.0) == {"models": ("a",), "rpm": 5}
    assert key_changes({"models": []}, 0.0) == {"models": ()}


def test_the_cli_writes_the_same_events(monkeypatch, store, capsys):
    from llmgw.cli import common, keys as keys_cli, main

    monkeypatch.setattr(keys_cli, "checked_store", lambda: store)
    monkeypatch.setattr(common, "who", lambda: "bob@box")
    assert main(["keys", "create", "team", "--models", "m"]) == 0
    assert main(["keys", "update", "team", "--rpm", "5"]) == 0
    assert main(["keys", "revoke", "team"]) == 0
    evs = key_events(store)
    assert [(e.kind, e.source, e.data["by"]) for e in evs] == [
        ("key_created", "cli", "bob@box"), ("key_updated", "cli", "bob@box"), ("key_revoked", "cli", "bob@box")]
    assert "updated key 'team'" in capsys.readouterr().out


def test_an_explained_request_is_readable_by_its_key_or_an_admin(store, upstreams):
    up = upstreams()
    store.write_endpoints([endpoint("e1", up.url)], "fp", time.time())
    _, admin = store.create_key("ops", admin=True)
    _, mine = store.create_key("mine")
    _, other = store.create_key("other")
    gw, c = client(store)
    r = c.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
               headers={**bearer(mine), "X-LLMGW-Explain": "1"})
    assert r.status_code == 200
    rid = r.headers["X-Request-Id"]
    got = c.get(f"/v1/llmgw/requests/{rid}", headers=bearer(mine))
    assert got.status_code == 200 and got.headers["Cache-Control"] == "no-store"
    doc = got.json
    assert doc["served_by"]["replica"] == "e1" and doc["key"] == "mine" and doc["status"] == 200
    assert any("Served by replica e1" in line for line in doc["explanation"])
    assert c.get(f"/v1/llmgw/requests/{rid}", headers=bearer(admin)).status_code == 200
    assert c.get(f"/v1/llmgw/requests/{rid}", headers=bearer(other)).status_code == 404
    assert c.get(f"/v1/llmgw/requests/{rid}").status_code == 401
    # Flushed to Redis with the usage: another gateway process answers it too, and `llmgw explain` reads it.
    gw.background.flush_traffic()
    assert store.served(rid).served_by["replica"] == "e1"
    _, c2 = client(store)
    assert c2.get(f"/v1/llmgw/requests/{rid}", headers=bearer(mine)).json["id"] == rid
    # A request that did not ask is not recorded.
    plain = c.post(CHAT, json={"model": "m"}, headers=bearer(mine))
    assert c.get(f"/v1/llmgw/requests/{plain.headers['X-Request-Id']}", headers=bearer(mine)).status_code == 404
    # A bad field: the gateway's own 400, recorded too, as the request of the key it sent.
    bad = c.post(CHAT, json={"model": "m", "temperature": "hot"}, headers={**bearer(mine), "X-LLMGW-Explain": "1"})
    assert bad.status_code == 400 and bad.json["error"]["param"] == "temperature"
    doc = c.get(f"/v1/llmgw/requests/{bad.headers['X-Request-Id']}", headers=bearer(mine)).json
    assert doc["status"] == 400 and doc["served_by"] == {} and "invalid_type" in doc["error"]
    assert c.get(f"/v1/llmgw/requests/{bad.headers['X-Request-Id']}", headers=bearer(other)).status_code == 404
