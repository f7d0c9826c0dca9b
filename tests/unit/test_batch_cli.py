"""`llmgw batches` through the real CLI on fakeredis: the list with progress and rate, show, cancel."""

from __future__ import annotations

import json

import pytest

from llmgw import cli
from llmgw.state import keys
from llmgw.state.batch_records import BatchRecord
from llmgw.state.store import Store


@pytest.fixture
def kicks(store, monkeypatch) -> list[str]:
    """`llmgw batches` reads this test's `store`; the batches it kicks are listed here, not sent."""
    monkeypatch.setattr("llmgw.cli.keys.checked_store", lambda: store)
    sent: list[str] = []
    monkeypatch.setattr("llmgw.cli.batches.kick.celery_run_sender", lambda app: sent.append)
    monkeypatch.setattr("llmgw.cli.batches.broker_app", lambda url: None)
    return sent


def make(s: Store, bid: str, created: float, **facts) -> None:
    kid, _ = s.create_key("team") if not s.list_keys() else (s.list_keys()[0].id, None)
    s.create_batch(BatchRecord(id=bid, owner=kid, endpoint="/v1/chat/completions", input_file_id="f",
                               completion_window="24h", created_at=created, expires_at=created + 86400, total=10,
                               model="chat", **facts))


def test_list_shows_progress_rate_and_time_left(store, kicks, capsys):
    make(store, "batch_old", 1.0, in_progress_at=2.0, progress=[[100.0, 0], [120.0, 4]])
    for i in range(4):
        store.record_line("batch_old", i, i != 3, "{}")
    make(store, "batch_new", 5.0)
    assert cli.main(["batches"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "OWNER", "MODEL", "STATUS", "DONE", "FAILED", "RATE/s", "ETA"]
    assert out[1].split()[:4] == ["batch_new", "team", "chat", "validating"]
    assert out[2].split() == ["batch_old", "team", "chat", "in_progress", "4/10", "40%", "1", "0.2", "30s"]
    assert cli.main(["batches", "list", "--json", "--active"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == ["batch_new", "batch_old"] and rows[1]["rate"] == 0.2


def test_show_and_cancel(store, kicks, capsys):
    make(store, "batch_a", 1.0, in_progress_at=2.0)
    assert cli.main(["batches", "show", "batch_a"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "in_progress"
    assert cli.main(["batches", "cancel", "batch_a"]) == 0
    assert store.batch("batch_a").status == "cancelling" and kicks == ["batch_a"]
    assert store.r.exists(keys.batch_queued("batch_a"))
    assert cli.main(["batches", "show", "nope"]) == 1
    assert "no batch named 'nope'" in capsys.readouterr().err
