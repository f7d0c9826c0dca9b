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


def test_cli_and_gateway_do_not_decode_key_json_themselves():
    """One record type: neither the CLI modules nor the gateway parse the key JSON by hand."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for f in ("llmgw/cli/keys.py", "llmgw/cli/usage.py", "gateway/auth.py", "gateway/app.py"):
        text = (root / f).read_text()
        assert "json.loads" not in text or f == "gateway/app.py", f
        assert "llmgw.cli" not in text or f.startswith("llmgw/cli"), f
