"""The process seam: start an attempt through the shim, observe it, signal it, find leftovers.

`ShimRunner` is the real one (Linux, /proc); tests of the agent loop pass a fake with the same
methods. Identity is never a pid alone: see `llmgw.proc.proctable`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmgw.engines.base import LaunchSpec
from llmgw.proc import proctable
from workers.agent.logfiles import replica_dir, tail_text
from workers.agent.shim import EXIT_FILE, LOG_FILE, SHIM_FILE, read_json
from workers.agent.supervisor import ExitFacts, Found

log = logging.getLogger("llmgw.agent")

SHIM_PATH = Path(__file__).with_name("shim.py")
# The replica record an attempt was started with (this node heads it): what the agent registers again
# if Redis loses its data while the engine runs (supervisor.restored).
RECORD_FILE = "record.json"


@dataclass(frozen=True)
class Seen:
    """One look at an attempt's process."""

    alive: bool
    exit: ExitFacts | None = None
    pid: int | None = None
    pid_start: int | None = None
    engine_pid: int | None = None


class ShimRunner:
    def __init__(self, state_dir: Path, log_max_bytes: int = 10 * 1024 * 1024, log_keep: int = 3):
        self.state_dir = Path(state_dir)
        self.log_max_bytes, self.log_keep = log_max_bytes, log_keep
        self.children: dict[str, tuple[int, subprocess.Popen]] = {}  # rid -> (attempt, shim)

    def dir(self, replica_id: str) -> Path:
        return replica_dir(self.state_dir, replica_id)

    # --- start -----------------------------------------------------------------------------------
    def spawn(self, replica_id: str, attempt: int, spec: LaunchSpec) -> tuple[int, int | None]:
        """Start the shim (its own session) which starts the engine. Returns (pid, pid_start)."""
        d = self.dir(replica_id)
        d.mkdir(parents=True, exist_ok=True)
        for stale in (EXIT_FILE, SHIM_FILE):
            (d / stale).unlink(missing_ok=True)
        argv = [
            sys.executable, str(SHIM_PATH),
            "--replica", replica_id, "--attempt", str(attempt), "--dir", str(d),
            "--log-max-bytes", str(self.log_max_bytes), "--log-keep", str(self.log_keep),
            *(("--cpus", ",".join(map(str, spec.cpus))) if spec.cpus else ()),
            "--", *spec.argv,
        ]
        # The agent's own environment plus the engine's: never a scrubbed one.
        env = {**os.environ, **spec.env, proctable.REPLICA_ENV: replica_id, proctable.ATTEMPT_ENV: str(attempt)}
        with open(d / "shim.log", "ab") as shim_log:
            popen = subprocess.Popen(
                argv, env=env, cwd=d, stdin=subprocess.DEVNULL, stdout=shim_log,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            )
        self.children[replica_id] = (attempt, popen)
        return popen.pid, proctable.start_ticks(popen.pid)

    # --- observe ---------------------------------------------------------------------------------
    def _exit_file(self, replica_id: str, attempt: int) -> ExitFacts | None:
        data = read_json(self.dir(replica_id) / EXIT_FILE)
        if not data or data.get("attempt") != attempt:
            return None
        return ExitFacts(data.get("exit_code"), data.get("exit_signal"), float(data.get("exited_at") or time.time()))

    def shim_file(self, replica_id: str) -> dict | None:
        return read_json(self.dir(replica_id) / SHIM_FILE)

    def observe(self, replica_id: str, attempt: int, pid: int | None, pid_start: int | None) -> Seen:
        engine_pid = None
        info = self.shim_file(replica_id)
        if info and info.get("attempt") == attempt:
            engine_pid = info.get("engine_pid")
            if pid is None:  # the agent died between starting it and recording its pid
                pid, pid_start = info.get("pid"), info.get("pid_start")
        child = self.children.get(replica_id)
        if child and child[0] == attempt:
            popen = child[1]
            rc = popen.poll()
            if rc is None:
                return Seen(True, None, popen.pid, pid_start, engine_pid)
            del self.children[replica_id]
            exit = self._exit_file(replica_id, attempt)
            if exit is None:  # the shim itself died (killed): its returncode is all we know
                exit = ExitFacts(rc, -rc if rc < 0 else None, time.time())
            self._kill_leftovers(popen.pid, replica_id)
            return Seen(False, exit, popen.pid, pid_start, engine_pid)
        if pid and proctable.is_same_process(pid, pid_start, replica_id):
            return Seen(True, None, pid, pid_start, engine_pid)
        exit = self._exit_file(replica_id, attempt)
        if pid:
            self._kill_leftovers(pid, replica_id)
        return Seen(False, exit, pid, pid_start, engine_pid)

    def _kill_leftovers(self, pgid: int, replica_id: str) -> None:
        """An engine (or its helpers) still running after its shim ended holds the port: kill it."""
        for member in proctable.group_members(pgid, replica_id):
            log.warning("replica %s: killing pid %d left behind by its shim", replica_id, member)
            try:
                os.kill(member, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # --- signal ----------------------------------------------------------------------------------
    def signal(self, replica_id: str, pid: int, pid_start: int | None, sig: int) -> None:
        """SIGTERM to the shim (it forwards it to the engine exactly once: llama-server treats a second
        SIGTERM as "terminate immediately"); SIGKILL to the whole process group. ESRCH = gone."""
        child = self.children.get(replica_id)
        ours = (child is not None and child[1].pid == pid and child[1].poll() is None) or (
            proctable.is_same_process(pid, pid_start, replica_id)
        )
        try:
            if ours:
                if sig == signal.SIGKILL:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
                return
        except ProcessLookupError:
            pass
        # The shim is gone; members of its group marked with this replica may remain.
        for member in proctable.group_members(pid, replica_id):
            try:
                os.kill(member, sig)
            except ProcessLookupError:
                pass

    # --- the state dir ---------------------------------------------------------------------------
    def discover(self) -> dict[str, Found]:
        """Every attempt recorded in the state dir (`shim.json`), alive or not."""
        for _attempt, popen in self.children.values():
            popen.poll()  # reap an exited shim now (observe() still reads its cached returncode)
        root = self.state_dir / "replicas"
        out: dict[str, Found] = {}
        try:
            entries = list(root.iterdir())
        except OSError:
            return out
        for d in entries:
            info = read_json(d / SHIM_FILE)
            if not info or not info.get("pid"):
                continue
            rid = str(info.get("replica_id") or d.name)
            pid, start = int(info["pid"]), info.get("pid_start")
            out[rid] = Found(rid, int(info.get("attempt") or 0), pid, start, info.get("engine_pid"),
                             proctable.is_same_process(pid, start, rid))
        return out

    def save_record(self, replica_id: str, record: dict) -> None:
        """Keep the record an attempt starts with beside it, written atomically (before the spawn)."""
        d = self.dir(replica_id)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (RECORD_FILE + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, d / RECORD_FILE)

    def saved_record(self, replica_id: str) -> dict | None:
        return read_json(self.dir(replica_id) / RECORD_FILE)

    def known_dirs(self) -> list[str]:
        try:
            return [d.name for d in (self.state_dir / "replicas").iterdir() if d.is_dir()]
        except OSError:
            return []

    def remove(self, replica_id: str) -> None:
        shutil.rmtree(self.dir(replica_id), ignore_errors=True)

    def last_activity(self, replica_id: str) -> float:
        try:
            return max(p.stat().st_mtime for p in self.dir(replica_id).iterdir())
        except (OSError, ValueError):
            return 0.0

    def log_path(self, replica_id: str) -> Path:
        return self.dir(replica_id) / LOG_FILE

    def log_tail(self, replica_id: str, max_bytes: int = 4000) -> str:
        return tail_text(self.log_path(replica_id), max_bytes)
