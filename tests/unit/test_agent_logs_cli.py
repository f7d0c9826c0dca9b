"""`llmgw logs`: the local log file when the replica runs here, else the record's log_tail."""

from __future__ import annotations

import fakeredis
import pytest

from llmgw.cli import main
from llmgw.settings import Settings
from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store


@pytest.fixture
def env(tmp_path, monkeypatch):
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    monkeypatch.setattr("llmgw.cli.logs.settings", lambda: Settings(state_dir=tmp_path))
    monkeypatch.setattr("llmgw.cli.logs.store", lambda s=None: store)
    return store, tmp_path


def test_local_log_file(env, capsys):
    store, root = env
    d = root / "replicas" / "r-local-1"
    d.mkdir(parents=True)
    (d / "engine.log").write_text("".join(f"line {i}\n" for i in range(500)))
    store.create_replica(ReplicaRecord(id="r-local-1", model="m", profile="p", node="a", log_tail="stale"))
    assert main(["logs", "r-local-1", "-n", "3"]) == 0
    assert capsys.readouterr().out == "line 497\nline 498\nline 499\n"
    assert main(["logs", "r-loc", "-n", "1"]) == 0  # a unique prefix, resolved through Redis
    assert capsys.readouterr().out == "line 499\n"


def test_remote_replica_shows_its_recorded_tail(env, capsys):
    store, _ = env
    store.create_replica(ReplicaRecord(id="r-remote", model="m", profile="p", node="b", log_tail="a\nb\nc\n"))
    assert main(["logs", "r-remote", "-n", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == "b\nc\n" and "node b" in out.err


def test_unknown_and_ambiguous(env, capsys):
    store, _ = env
    assert main(["logs", "nope"]) == 1
    assert "no replica named 'nope'" in capsys.readouterr().err
    for rid in ("r-x1", "r-x2"):
        store.create_replica(ReplicaRecord(id=rid, model="m", profile="p", node="b"))
    assert main(["logs", "r-x"]) == 1
    assert "ambiguous" in capsys.readouterr().err


def test_follow_survives_rotation(tmp_path):
    import io
    import threading

    from llmgw.cli.logs import _follow

    log = tmp_path / "engine.log"
    log.write_text("old\n")
    out, done = io.StringIO(), threading.Event()
    t = threading.Thread(target=_follow, args=(log, out, 0.02, done.is_set))
    t.start()
    try:
        from harness.procs import wait_until

        def append_one():  # the follower starts at the end of the file: write until it has seen one
            with open(log, "a") as f:
                f.write("one\n")
            return "one" in out.getvalue()

        wait_until(append_one, 5)
        with open(log, "a") as f:
            f.write("two\n")
        log.rename(tmp_path / "engine.log.1")  # rotated before the follower looked again
        log.write_text("three\n")
        wait_until(lambda: "three" in out.getvalue(), 5)
    finally:
        done.set()
        t.join(5)
    assert out.getvalue().endswith("one\ntwo\nthree\n") and "old" not in out.getvalue()
