"""`llmgw keys` and `llmgw usage` on fakeredis: keys shown once and stored hashed, clear errors."""

import json

import fakeredis
import pytest

from llmgw.cli import keys as keys_cli
from llmgw.cli import main
from llmgw.state import keys


@pytest.fixture
def r(monkeypatch):
    r = fakeredis.FakeRedis(decode_responses=True)
    monkeypatch.setattr(keys_cli, "redis_client", lambda: r)
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
    kid, _ = keys_cli.create_key(r, "team-a")
    r.hset(keys.usage(kid), mapping={"m:prompt": 5, "m:completion": 7, "m:requests": 2})
    r.hset(keys.usage("anonymous"), mapping={"m:prompt": 1, "m:completion": 1, "m:requests": 1})
    r.hset(keys.usage("k-gone"), mapping={"x:prompt": 1, "x:requests": 1})
    from llmgw.cli.usage import read_usage

    rows = {(row["key"], row["model"]): row for row in read_usage(r)}
    assert rows[("team-a", "m")] == {"key": "team-a", "id": kid, "model": "m", "prompt_tokens": 5,
                                     "completion_tokens": 7, "requests": 2}
    assert ("anonymous", "m") in rows and ("k-gone (revoked)", "x") in rows
