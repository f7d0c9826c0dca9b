"""LLMGW_CATALOG: the file watcher applies changes, is cheap when nothing changed, and logs a bad
change once while the running catalog stays."""

from __future__ import annotations

import logging
import os

import fakeredis
import pytest

from llmgw.catalog import read_applied, sync_from_file
from llmgw.catalog import watch as catalog_watch
from llmgw.state.store import Store

GOOD = "models:\n  - {name: m, profiles: [{name: s, engine: sim, replicas: %d}]}\n"
BAD = "models:\n  - {name: m, profiles: [{name: s, engine: sim, replicas: -1}]}\n"


@pytest.fixture
def r():
    return Store(fakeredis.FakeRedis(decode_responses=True))


def write(path, text, bump: int = 0):
    path.write_text(text)
    if bump:  # make sure the stamp moves even on coarse-mtime filesystems
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump))


def test_applies_then_is_cheap_when_unchanged(r, tmp_path, monkeypatch):
    f = tmp_path / "catalog.yaml"
    write(f, GOOD % 1)
    res = sync_from_file(r, f, "watcher")
    assert res.applied and res.version == 1 and res.problems == []
    assert read_applied(r).catalog.model("m").profiles[0].replicas == 1

    calls = []
    monkeypatch.setattr(catalog_watch, "parse_catalog_bytes", lambda *a, **k: calls.append(a))
    real_read = type(f).read_bytes
    monkeypatch.setattr(type(f), "read_bytes", lambda self: calls.append(self) if self == f else real_read(self))
    for _ in range(3):
        assert sync_from_file(r, f, "watcher") == catalog_watch.SyncResult(False, 1, [])
    assert calls == []  # an unchanged file is neither re-read nor parsed: one stat, one HGETALL
    monkeypatch.undo()


def test_touch_without_change_applies_nothing(r, tmp_path):
    f = tmp_path / "catalog.yaml"
    write(f, GOOD % 1)
    sync_from_file(r, f, "w")
    write(f, GOOD % 1, bump=10_000_000)
    assert sync_from_file(r, f, "w") == catalog_watch.SyncResult(False, 1, [])


def test_bad_change_is_logged_once_and_ignored(r, tmp_path, caplog):
    f = tmp_path / "catalog.yaml"
    write(f, GOOD % 1)
    sync_from_file(r, f, "w")
    write(f, BAD, bump=10_000_000)
    with caplog.at_level(logging.WARNING, logger="llmgw.catalog"):
        results = [sync_from_file(r, f, "w") for _ in range(5)]
    assert all(not x.applied and x.version == 1 for x in results)
    assert all("replicas: must be at least 0" in x.problems[0] for x in results)
    assert len([rec for rec in caplog.records if "invalid" in rec.getMessage()]) == 1
    assert read_applied(r).version == 1  # the running catalog stays

    # another control worker (same Redis) does not log it again either
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmgw.catalog"):
        sync_from_file(r, f, "other-worker")
    assert not caplog.records

    write(f, GOOD % 3, bump=20_000_000)
    res = sync_from_file(r, f, "w")
    assert res.applied and res.version == 2 and res.problems == []


def test_missing_file_keeps_the_catalog_and_logs_once(r, tmp_path, caplog):
    f = tmp_path / "catalog.yaml"
    write(f, GOOD % 1)
    sync_from_file(r, f, "w")
    f.unlink()
    with caplog.at_level(logging.WARNING, logger="llmgw.catalog"):
        a = sync_from_file(r, f, "w")
        b = sync_from_file(r, f, "w")
    assert not a.applied and a.version == 1 and "cannot read" in a.problems[0] and a == b
    assert len(caplog.records) == 1
    write(f, GOOD % 2)
    assert sync_from_file(r, f, "w").applied


def test_content_already_applied_by_hand_is_not_a_new_version(r, tmp_path):
    from llmgw.catalog import apply_catalog, parse_catalog_text

    apply_catalog(r, parse_catalog_text(GOOD % 4), source="cli", applied_by="ops")
    f = tmp_path / "catalog.yaml"
    write(f, GOOD % 4)
    assert sync_from_file(r, f, "w") == catalog_watch.SyncResult(False, 1, [])
