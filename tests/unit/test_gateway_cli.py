"""`llmgw keys` and `llmgw usage` on fakeredis: keys shown once and stored hashed, clear errors."""

import json

import fakeredis
import pytest

from llmgw.cli import keys as keys_cli
from llmgw.cli import main
from llmgw.state import keys
from llmgw.state.store import Store


@pytest.fixture
def r(monkeypatch):
    r = fakeredis.FakeRedis(decode_responses=True)
    monkeypatch.setattr(keys_cli, "checked_store", lambda: Store(r))
    return r


def test_create_list_revoke(r, capsys):
    assert main(["keys", "create", "team-a", "--rpm", "10", "--priority", "critical"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("sk-llmgw-")
    stored = json.dumps(r.hgetall(keys.API_KEYS))
    assert key not in stored and keys_cli.hash_key(key) in stored
    assert main(["keys", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(d["name"], d["rpm"], d["priority"]) for d in rows] == [("team-a", 10, "critical")]
    assert "hash" not in rows[0]
    assert main(["keys", "create", "team-a"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["keys", "revoke", "team-a"]) == 0
    assert r.hlen(keys.API_KEYS) == 0 and not r.keys(keys.api_key_by_hash("*"))
    assert main(["keys", "revoke", "team-a"]) == 1
    assert "no API key named 'team-a'" in capsys.readouterr().err


def test_bad_arguments_are_one_line_errors(r, capsys):
    assert main(["keys", "create", "x", "--tpm", "-5"]) == 1
    err = capsys.readouterr().err
    assert "--tpm: must be a positive integer" in err and "Traceback" not in err


def test_usage_rows(r, capsys):
    kid, _ = Store(r).create_key("team-a")
    r.hset(keys.usage(kid), mapping={"m:prompt": 5, "m:completion": 7, "m:requests": 2})
    r.hset(keys.usage("anonymous"), mapping={"m:prompt": 1, "m:completion": 1, "m:requests": 1})
    r.hset(keys.usage("k-gone"), mapping={"x:prompt": 1, "x:requests": 1})
    from llmgw.cli.usage import read_usage

    rows = {(row["key"], row["model"]): row for row in read_usage(Store(r))}
    assert rows[("team-a", "m")] == {"key": "team-a", "id": kid, "model": "m", "prompt_tokens": 5,
                                     "completion_tokens": 7, "requests": 2}
    assert ("anonymous", "m") in rows and ("k-gone (revoked)", "x") in rows


def test_create_and_update_policy(r, capsys):
    assert main(["keys", "create", "team-b", "--models", "m,x", "--expires", "30d", "--budget", "5M",
                 "--budget-period", "day"]) == 0
    key = capsys.readouterr().out.strip()
    [rec] = Store(r).list_keys()
    assert (rec.models, rec.budget, rec.budget_period, rec.admin) == (("m", "x"), 5_000_000, "day", False)
    assert rec.expires_at is not None and rec.hash == keys_cli.hash_key(key)
    assert main(["keys", "update", "team-b", "--models", "all", "--expires", "never", "--admin", "--rpm", "7"]) == 0
    assert "updated key 'team-b'" in capsys.readouterr().out
    [new] = Store(r).list_keys()
    assert (new.models, new.expires_at, new.admin, new.rpm, new.budget) == ((), None, True, 7, 5_000_000)
    assert new.hash == rec.hash and new.id == rec.id  # the key itself never changes
    assert main(["keys", "update", "team-b", "--budget", "none", "--no-admin"]) == 0
    [last] = Store(r).list_keys()
    assert (last.budget, last.budget_period, last.admin) == (None, None, False)
    assert main(["keys", "list"]) == 0
    assert "team-b" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["keys", "create", "x", "--expires", "yesterday"], "--expires: expected a duration"),
    (["keys", "create", "x", "--budget", "lots"], "--budget: expected a number of tokens"),
    (["keys", "create", "x", "--budget-period", "day"], "--budget-period: the key has no --budget"),
    (["keys", "create", "x", "--rpm", "many"], "--rpm: expected an integer"),
    (["keys", "update", "ghost", "--rpm", "3"], "no API key named 'ghost'"),
])
def test_bad_policy_flags_change_nothing(r, capsys, argv, says):
    before = dict(r.hgetall(keys.API_KEYS))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert r.hgetall(keys.API_KEYS) == before


def test_update_needs_a_change(r, capsys):
    Store(r).create_key("a")
    assert main(["keys", "update", "a"]) == 2
    assert "nothing to change" in capsys.readouterr().err


def test_usage_shows_budgets(r, capsys):
    import time

    kid, _ = Store(r).create_key("b", budget=100, budget_period="day")
    period = Store(r).find_key("b").period(time.time())
    r.set(keys.budget(kid, period.id), 40)
    assert main(["usage", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budgets"] == [{"key": "b", "id": kid, "tokens": 100, "period": "day", "period_id": period.id,
                               "used": 40, "remaining": 60, "resets_at": out["budgets"][0]["resets_at"]}]
    assert main(["usage"]) == 0
    text = capsys.readouterr().out
    assert "REMAINING" in text and " 60 " in text


def test_weight_and_sub_tenants(r, capsys):
    assert main(["keys", "create", "batch", "--weight", "0.5"]) == 0
    assert main(["keys", "create", "app", "--weight", "2", "--sub-tenants"]) == 0
    capsys.readouterr()
    by = {k.name: k for k in Store(r).list_keys()}
    assert (by["batch"].weight, by["batch"].sub_tenants) == (0.5, False)
    assert (by["app"].weight, by["app"].sub_tenants) == (2.0, True)
    assert main(["keys", "update", "app", "--weight", "3", "--no-sub-tenants"]) == 0
    assert "weight 3" in capsys.readouterr().out
    assert main(["keys", "list"]) == 0
    listing = capsys.readouterr().out
    assert "WEIGHT" in listing and " 0.5 " in listing
    before = dict(r.hgetall(keys.API_KEYS))
    assert main(["keys", "update", "app", "--weight", "0"]) == 1
    err = capsys.readouterr().err
    assert "--weight: must be between 0.01 and 1000" in err and "Traceback" not in err
    assert r.hgetall(keys.API_KEYS) == before


def test_usage_shows_fair_queueing_service(r, capsys):
    import time

    from llmgw.state.tenants import TenantDelta

    kid, _ = Store(r).create_key("team-a", weight=2.0)
    Store(r).add_tenants({("m", kid): TenantDelta(50.0, 100.0, 1.5, 3)}, int(time.time() // 60))
    assert main(["usage", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["service"] == [{"key": "team-a", "id": kid, "model": "m", "weight": 2.0, "service_tokens": 100,
                               "requests": 3, "mean_wait": 0.5, "share": 1.0}]
    assert main(["usage", "--key", "team-a"]) == 0
    text = capsys.readouterr().out
    assert "SHARE 5m" in text and "100.0%" in text and "0.500s" in text


def test_isolate_cache_is_off_by_default_and_set_by_create_and_update(r, capsys):
    assert main(["keys", "create", "shared"]) == 0
    assert main(["keys", "create", "private", "--isolate-cache"]) == 0
    capsys.readouterr()
    by = {k.name: k for k in Store(r).list_keys()}
    assert (by["shared"].isolate_cache, by["private"].isolate_cache) == (False, True)
    assert main(["keys", "update", "shared", "--isolate-cache"]) == 0
    assert "isolated cache" in capsys.readouterr().out
    assert main(["keys", "update", "private", "--no-isolate-cache"]) == 0
    capsys.readouterr()
    by = {k.name: k for k in Store(r).list_keys()}
    assert (by["shared"].isolate_cache, by["private"].isolate_cache) == (True, False)
    assert by["shared"].hash and by["shared"].id  # the key itself is the same key
    assert main(["keys", "list", "--json"]) == 0
    assert {d["name"]: d["isolate_cache"] for d in json.loads(capsys.readouterr().out)} == {
        "shared": True, "private": False}
