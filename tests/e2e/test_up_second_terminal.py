"""A second terminal beside `llmgw up`: commands run in the same directory (or with LLMGW_STATE_DIR),
without LLMGW_REDIS_URL, find the stack it started; `catalog apply --wait` from there shows a line per
replica change when piped; a clean stop removes the stack file."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from harness.procs import ProcessSet, free_port, python, wait_until

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: chat
    profiles:
      - {{name: cpu, engine: sim, replicas: {n}}}
"""
# `  chat/cpu <id>  <State> [<elapsed>][: <what it waits for>]`, as `apply --wait` prints them piped.
PROGRESS = re.compile(r"^  chat/cpu (\S+)  (\w+)(?: for [\d.]+[smhd])?(?:: (.*))?$")


def fresh_env(**extra: str) -> dict[str, str]:
    """A new shell's environment: nothing says where Redis or the state dir is."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "LLMGW_REDIS_URL", "LLMGW_STATE_DIR")}
    return {**env, **extra}


def llmgw(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([python(), "-m", "llmgw", *args], env=fresh_env(**env), cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_llmgw_status_in_another_shell_finds_the_stack_llmgw_up_started(tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    (work / "catalog.yaml").write_text(CATALOG.format(n=1))
    procs = ProcessSet(tmp_path / "logs", env=fresh_env())
    up = procs.start("up", [python(), "-m", "llmgw", "up", "--catalog", "catalog.yaml", "--port", str(free_port()),
                            "--node", "solo"], cwd=work)
    try:
        wait_until(lambda: "press Ctrl-C to stop" in up.log() or not up.alive(), 120, what="llmgw up ready")
        assert up.alive(), up.log()
        redis_port = re.search(r"started Redis on 127\.0\.0\.1:(\d+)", up.log()).group(1)
        assert f"  export LLMGW_REDIS_URL=redis://127.0.0.1:{redis_port}/0" in up.log().splitlines()
        stack_file = work / ".llmgw" / "stack.json"
        assert stat.S_IMODE(stack_file.stat().st_mode) == 0o600

        status = llmgw("status", "--json", cwd=work)
        assert status.returncode == 0, status.stderr
        (replica,) = json.loads(status.stdout)["replicas"]
        assert (replica["model"], replica["state"], replica["listed"]) == ("chat", "Ready", True)
        table = llmgw("status", cwd=work)
        assert table.returncode == 0 and replica["id"] in table.stdout and table.stderr == ""
        elsewhere = llmgw("status", cwd=tmp_path, LLMGW_STATE_DIR=str(work / ".llmgw"))
        assert elsewhere.returncode == 0 and replica["id"] in elsewhere.stdout, elsewhere.stderr

        (work / "more.yaml").write_text(CATALOG.format(n=2))
        applied = llmgw("catalog", "apply", "--wait", "more.yaml", cwd=work)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        seen: dict[str, list[tuple[str, str]]] = {}
        for line in applied.stdout.splitlines():
            m = PROGRESS.match(line)
            if m:
                seen.setdefault(m.group(1), []).append((m.group(2), m.group(3) or ""))
        (new,) = set(seen) - {replica["id"]}
        assert seen[replica["id"]] == [("Ready", "")]  # one line: it never changed
        assert seen[new][-1] == ("Ready", ""), applied.stdout
        changes = seen[new]
        assert all(a != b for a, b in zip(changes, changes[1:])), applied.stdout  # a line per change only
        assert "  chat/cpu: 2 of 2 Ready after" in applied.stdout and "\x1b" not in applied.stdout

        up.signal_group(signal.SIGINT)
        assert up.popen.wait(60) == 0, up.log()
        assert not stack_file.exists()  # a clean stop leaves nothing for others to trust
        gone = llmgw("status", cwd=work)
        assert replica["id"] not in gone.stdout
    finally:
        procs.stop_all()
