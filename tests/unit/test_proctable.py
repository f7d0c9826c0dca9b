"""The process-table and port helpers live once, in llmgw, and are what the agent, `llmgw up` and the
test harness use."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from llmgw.local import localstack
from llmgw.proc import ports, proctable
from harness import procs
from harness.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_pids_with_env_finds_a_marked_process_and_not_after_it_exits():
    marker = uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         env={**os.environ, "LLMGW_PT_MARK": marker})
    try:
        wait_until(lambda: proctable.pids_with_env("LLMGW_PT_MARK", marker) == [p.pid], 5, what="the marked child")
        assert proctable.pids_with_env("LLMGW_PT_MARK", marker + "x") == []  # an exact match only
        assert proctable.describe(p.pid).startswith(f"{p.pid}: {sys.executable} -c")
    finally:
        p.kill()
    # Killed but not yet reaped, it is a zombie: not counted as a live leak.
    wait_until(lambda: proctable.pids_with_env("LLMGW_PT_MARK", marker) == [], 5, what="the zombie to be ignored")
    p.wait()


def test_one_implementation_behind_every_old_name():
    assert procs.free_port is ports.free_port and procs.free_port_range is ports.free_port_range
    assert procs.describe is proctable.describe
    assert localstack.free_port is ports.free_port
    from workers.agent import loop, runner

    assert loop.can_bind is ports.can_bind and runner.proctable is proctable
    assert not (ROOT / "workers" / "agent" / "proctable.py").exists()


def test_port_helpers():
    lo, hi = ports.free_port_range(5, procs.TEST_PORT_RANGE)
    assert hi - lo == 4 and all(ports.can_bind("127.0.0.1", p) for p in range(lo, hi + 1))
    assert procs.TEST_PORT_RANGE[0] <= lo and hi <= procs.TEST_PORT_RANGE[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", lo))
        s.listen()
        assert not ports.can_bind("127.0.0.1", lo) and not localstack.port_is_free(lo)


def test_llmgw_never_imports_workers_gateway_or_beat():
    bad = []
    for path in (ROOT / "llmgw").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("workers", "gateway", "beat")]
    assert bad == []
