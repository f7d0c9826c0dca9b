"""llmgw.state.keypolicy: the typed key record shared by the CLI and the gateway; the store's keys."""

import json

import fakeredis
import pytest

from llmgw.errors import NotFound
from llmgw.state import keys
from llmgw.state.keypolicy import ApiKeyInvalid, ApiKeyRecord, cap_priority, hash_key, new_key, parse_table
from llmgw.state.store import Store


def test_new_key_is_pure_given_its_randomness():
    rec, key = new_key("a", 10, None, "standard", 5.0, token=lambda n: "T" * n, hexid=lambda n: "ab" * n)
    assert key == "sk-llmgw-" + "T" * 32
    assert rec == ApiKeyRecord("k-abababab", "a", hash_key(key), 10, None, "standard", 5.0)
    assert ApiKeyRecord.from_json(rec.id, rec.to_json()) == rec
    assert "hash" not in rec.public() and key not in rec.to_json()


@pytest.mark.parametrize("args, flag", [(("", None, None, None), "NAME"), (("a", 0, None, None), "--rpm"),
                                         (("a", None, -1, None), "--tpm"), (("a", None, None, "vip"), "--priority")])
def test_bad_arguments_name_the_flag(args, flag):
    with pytest.raises(ApiKeyInvalid, match=flag):
        new_key(*args, now=0.0)


def test_parse_table_reports_malformed_records():
    good, _ = new_key("a", None, None, None, 1.0)
    recs, problems = parse_table({good.id: good.to_json(), "k-bad": "{nope", "k-nohash": json.dumps({"name": "x"}),
                                  "k-prio": json.dumps({"hash": "h", "priority": "urgent"})})
    assert recs == [good]
    assert sorted(p.split(":")[0] for p in problems) == ["API key record k-bad", "API key record k-nohash",
                                                         "API key record k-prio"]


def test_redis_round_trip_without_the_by_hash_index():
    r = fakeredis.FakeRedis(decode_responses=True)
    store = Store(r)
    kid, key = store.create_key("team-a", rpm=5, priority="sheddable", now=3.0)
    [rec] = store.list_keys()
    assert (rec.id, rec.name, rec.hash, rec.rpm, rec.priority) == (kid, "team-a", hash_key(key), 5, "sheddable")
    assert not r.keys(keys.api_key_by_hash("*"))  # the gateway caches the table; no index to keep in step
    with pytest.raises(ApiKeyInvalid, match="already exists"):
        store.create_key("team-a")
    r.set(keys.api_key_by_hash(rec.hash), kid)  # as written by an older version
    assert store.revoke_key("team-a") == kid
    assert r.hlen(keys.API_KEYS) == 0 and not r.keys(keys.api_key_by_hash("*"))
    with pytest.raises(NotFound):
        store.revoke_key("team-a")


@pytest.mark.parametrize("req, ceiling, out", [("critical", "standard", "standard"), ("sheddable", "standard", "sheddable"),
                                               ("critical", "critical", "critical"), ("standard", "sheddable", "sheddable")])
def test_cap_priority(req, ceiling, out):
    assert cap_priority(req, ceiling) == out


def test_cli_and_gateway_do_not_decode_key_json_themselves(monkeypatch, capsys):
    """One record type: the CLI (`llmgw keys list`, `llmgw usage`) and the gateway's key table read
    every key record through `ApiKeyRecord.from_json`, never by hand. (That the key policy imports no
    CLI is an import-linter contract in pyproject.toml.)"""
    from gateway.keys.table import KeyTable
    from gateway.observe.health import RedisHealth
    from llmgw.cli import keys as keys_cli
    from llmgw.cli import main
    from llmgw.cli.usage import read_usage
    from llmgw.state.clock import Clock
    from llmgw.state.store import Store

    store = Store(fakeredis.FakeRedis(decode_responses=True))
    monkeypatch.setattr(keys_cli, "checked_store", lambda: store)
    store.create_key("a")
    store.create_key("b", rpm=3)
    decoded = []
    real = ApiKeyRecord.from_json.__func__

    def counted(cls, key_id, blob):
        decoded.append(key_id)
        return real(cls, key_id, blob)

    monkeypatch.setattr(ApiKeyRecord, "from_json", classmethod(counted))
    table = KeyTable(store, RedisHealth(Clock()))
    table.refresh()
    assert len(decoded) == 2 and {k.name for k in table.by_hash.values()} == {"a", "b"}
    assert main(["keys", "list", "--json"]) == 0
    assert len(decoded) == 4 and {row["name"] for row in json.loads(capsys.readouterr().out)} == {"a", "b"}
    read_usage(store)
    assert len(decoded) == 6
