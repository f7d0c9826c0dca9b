"""Every `llmgw` command finds the stack `llmgw up` runs from the same directory (or LLMGW_STATE_DIR)
through its stack file, trusts it only while that `llmgw up` still runs, and an explicit Redis URL
always wins."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from llmgw import cli
from llmgw.cli import common
from llmgw.cli.up import catalog_lines, default_catalog, default_catalog_path, export_line, found_by
from llmgw.local import stackfile
from llmgw.local.localstack import LocalStack
from llmgw.local.stackfile import StackInfo, find_stack
from llmgw.proc.proctable import start_ticks
from llmgw.settings import Settings

STACK_URL = "redis://127.0.0.1:41061/0"


def me(url: str = STACK_URL, pid_start: int | None = None) -> StackInfo:
    """A stack file naming this test process, which is running."""
    pid = os.getpid()
    return StackInfo(url, "http://127.0.0.1:8080", pid, start_ticks(pid) if pid_start is None else pid_start,
                     time.time())


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A fresh directory as cwd, no Redis URL nor state dir in the environment; Redis always answers."""
    monkeypatch.chdir(tmp_path)
    for var in ("REDIS_URL", "LLMGW_REDIS_URL", "LLMGW_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    pinged = []
    monkeypatch.setattr(stackfile, "redis_answers", lambda url: pinged.append(url) or True)
    (tmp_path / ".llmgw").mkdir()
    return tmp_path / ".llmgw", pinged


def test_a_live_stack_in_this_directory_gives_its_redis_url(here, capsys):
    state, pinged = here
    stackfile.write(state, me())
    assert common.settings().redis_url == STACK_URL
    assert pinged == [STACK_URL]  # checked that its Redis answers before using it
    assert capsys.readouterr().err == ""  # found quietly


def test_a_stack_file_whose_process_is_gone_is_ignored_with_one_note(here, capsys):
    state, pinged = here
    pid = dead_pid()
    stackfile.write(state, StackInfo(STACK_URL, "http://127.0.0.1:8080", pid, 12345, time.time()))
    s = common.settings()
    assert s.redis_url == Settings().redis_url  # today's default, never the stale file's
    assert pinged == []
    err = capsys.readouterr().err.splitlines()
    assert err == [f"llmgw: ignored the stale {state / 'stack.json'}: llmgw up (pid {pid}) is not running"]


def test_a_reused_pid_is_told_apart_by_its_start_time(here, capsys):
    state, pinged = here
    stackfile.write(state, me(pid_start=start_ticks(os.getpid()) + 1))  # this pid, another process's start
    assert common.settings().redis_url == Settings().redis_url
    assert pinged == []
    assert "that pid is another process now" in capsys.readouterr().err


def test_an_explicit_redis_url_always_wins(here, monkeypatch):
    state, pinged = here
    stackfile.write(state, me())
    for var in ("LLMGW_REDIS_URL", "REDIS_URL"):
        monkeypatch.setenv(var, "redis://elsewhere:6379/3")
        found = common.locate()
        assert found.settings.redis_url == "redis://elsewhere:6379/3" and found.lookup is None
        monkeypatch.delenv(var)
    assert pinged == []


def test_a_stack_whose_redis_does_not_answer_is_not_used(here, monkeypatch):
    state, _ = here
    stackfile.write(state, me("redis://:s3cret@127.0.0.1:41061/0"))
    monkeypatch.setattr(stackfile, "redis_answers", lambda url: False)
    found = common.locate()
    assert found.settings.redis_url == Settings().redis_url
    (note,) = found.lookup.notes
    assert "runs, but its Redis at redis://:***@127.0.0.1:41061/0 does not answer" in note
    assert "s3cret" not in found.hint()


def test_this_directory_is_searched_first_then_llmgw_state_dir(here, tmp_path, monkeypatch):
    state, _ = here
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.setenv("LLMGW_STATE_DIR", str(other))
    stackfile.write(other, me("redis://127.0.0.1:2/0"))
    assert common.settings().redis_url == "redis://127.0.0.1:2/0"  # only LLMGW_STATE_DIR has one
    stackfile.write(state, me())
    assert common.settings().redis_url == STACK_URL
    assert common.locate().lookup.where == state


def test_no_stack_found_keeps_todays_message_and_says_where_it_looked(here, monkeypatch, capsys):
    state, _ = here

    def unreachable(*_):
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr("llmgw.cli.status.store", unreachable)
    assert cli.main(["status"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("llmgw: cannot reach Redis at redis://127.0.0.1:6379/0: Error 111")
    assert line.endswith(f"(set REDIS_URL or LLMGW_REDIS_URL); no local stack found in {state} "
                         "(`llmgw up` there starts one)")


def test_an_explicit_url_that_does_not_answer_gets_no_local_stack_hint(here, monkeypatch, capsys):
    monkeypatch.setenv("LLMGW_REDIS_URL", "redis://127.0.0.1:9/0")

    def unreachable(*_):
        raise redis.ConnectionError("refused")

    monkeypatch.setattr("llmgw.cli.status.store", unreachable)
    assert cli.main(["status"]) == 1
    assert capsys.readouterr().err.strip() == (
        "llmgw: cannot reach Redis at redis://127.0.0.1:9/0: refused (set REDIS_URL or LLMGW_REDIS_URL)")


def test_the_stack_file_is_private_replaced_whole_and_removed_only_by_its_owner(tmp_path):
    path = stackfile.write(tmp_path, me("redis://:pw@127.0.0.1:1/0"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["stack.json"]  # no temporary file left
    ours = StackInfo.from_json(path.read_text())
    assert ours.redis_url == "redis://:pw@127.0.0.1:1/0" and ours.pid == os.getpid()
    newer = StackInfo(STACK_URL, "http://127.0.0.1:8081", ours.pid, ours.pid_start + 7, time.time())
    stackfile.write(tmp_path, newer)  # another `llmgw up` replaced it
    stackfile.remove(tmp_path, ours)
    assert StackInfo.from_json(path.read_text()) == newer  # not ours to remove
    stackfile.remove(tmp_path, newer)
    assert not path.exists()


def test_an_unreadable_stack_file_is_ignored_with_a_note(tmp_path):
    stackfile.stack_path(tmp_path).write_text("{not json")
    found = find_stack([tmp_path], answers=lambda url: True)
    assert found.stack is None
    assert found.notes[0].startswith(f"ignored {tmp_path / 'stack.json'}: not a stack file written by llmgw up")


def test_local_stack_announces_itself_and_stop_all_removes_the_file(tmp_path):
    stack = LocalStack(tmp_path / "state", env={})
    info = stack.announce("redis://127.0.0.1:41061/0", "http://127.0.0.1:8080")
    found = find_stack([tmp_path / "state"], answers=lambda url: True)
    assert found.stack == info and found.where == tmp_path / "state"
    stack.stop_all()
    assert not stackfile.stack_path(tmp_path / "state").exists()


def test_llmgw_up_refuses_a_state_dir_a_running_llmgw_up_holds(here, capsys):
    from llmgw.proc.ports import free_port

    state, _ = here
    before = stackfile.write(state, me()).read_text()
    assert cli.main(["up", "--port", str(free_port()), "--state-dir", str(state)]) == 1
    err = capsys.readouterr().err
    assert f"llmgw up already runs in {state} (pid {os.getpid()}, gateway http://127.0.0.1:8080)" in err
    assert stackfile.stack_path(state).read_text() == before  # nothing started, nothing replaced
    assert not (state / "logs").exists()


def test_llmgw_up_prints_the_line_other_shells_export(tmp_path):
    assert export_line("redis://127.0.0.1:41061/0", tmp_path) == "export LLMGW_REDIS_URL=redis://127.0.0.1:41061/0"
    line = export_line("rediss://:pa%24s@h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.crt", tmp_path)
    assert line.startswith("export LLMGW_REDIS_URL='rediss://:***@h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.crt'")
    assert "pa%24s" not in line and str(tmp_path / "stack.json") in line
    assert found_by(tmp_path / ".llmgw", tmp_path) == f"llmgw commands run from {tmp_path} find this stack by themselves"
    assert "LLMGW_STATE_DIR=/srv/x" in found_by(Path("/srv/x"), tmp_path)


def test_llmgw_up_names_the_catalog_it_applied_and_how_to_copy_the_default():
    path = default_catalog_path()
    assert Path(path).is_file() and Path(path).name == "default_catalog.yaml"
    assert [m.name for m in default_catalog().models] == ["smollm2"]
    first, copy, then = catalog_lines(path, False, ["smollm2"], 1)
    assert first == (f"catalog version 1: the default catalog {path} (smollm2); to serve other models, copy it "
                     "and edit the copy:")
    assert copy.strip() == f"cp {path} my-catalog.yaml"
    assert "llmgw catalog apply my-catalog.yaml" in then and "llmgw up --catalog my-catalog.yaml" in then
    assert catalog_lines("/srv/c.yaml", True, ["a", "b"], 3, changed=False) == [
        "catalog version 3 (unchanged): /srv/c.yaml (a, b); change it with `llmgw catalog apply FILE` while this runs"]
