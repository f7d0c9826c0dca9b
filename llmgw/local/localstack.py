"""The whole system on one machine, as `llmgw up` runs it: Redis, a control worker, beat, one node
agent and the gateway, each a child process in its own session with its log in the state directory.

Every child carries LLMGW_UP_TOKEN in its environment, and the engines the agent starts inherit it;
on shutdown, after stopping the children in order, anything still carrying the token is killed, so
Ctrl-C never leaves an orphan behind. `announce` writes the stack file other `llmgw` commands find it
by (llmgw.local.stackfile); `stop_all` removes it first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llmgw.local import stackfile
from llmgw.proc.ports import can_bind, free_port  # noqa: F401 - free_port is part of this module's API
from llmgw.proc.proctable import pids_with_env, start_ticks

TOKEN_VAR = "LLMGW_UP_TOKEN"


def port_is_free(port: int) -> bool:
    """True if a server could listen on 127.0.0.1:port now."""
    return can_bind("127.0.0.1", port)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float) -> None:
        if self.alive():
            _killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                _killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        _killpg(self.popen.pid, signal.SIGKILL)  # stragglers left in the group

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class LocalStack:
    state_dir: Path
    env: dict[str, str]
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    children: list[Child] = field(default_factory=list)
    announced: stackfile.StackInfo | None = None

    def __post_init__(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "logs").mkdir(exist_ok=True)

    def child_env(self) -> dict[str, str]:
        return {**os.environ, **self.env, TOKEN_VAR: self.token, "PYTHONUNBUFFERED": "1"}

    def start(self, name: str, argv: list[str]) -> Child:
        log_path = self.state_dir / "logs" / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv,
                env=self.child_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            )
        child = Child(name, popen, log_path)
        self.children.append(child)
        return child

    def announce(self, redis_url: str, gateway_url: str) -> stackfile.StackInfo:
        """Write the stack file: from now on `llmgw` commands run here find this stack's Redis."""
        me = os.getpid()
        info = stackfile.StackInfo(redis_url, gateway_url, me, start_ticks(me) or 0, time.time())
        stackfile.write(self.state_dir, info)
        self.announced = info
        return info

    def forget(self, child: Child) -> None:
        """A child that exited on its own and is replaced (Redis that lost its port): no longer watched."""
        self.children.remove(child)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop_all(self, grace: float = 15.0) -> None:
        """Stop in reverse start order (gateway, agent and its engines, beat, control, Redis last)."""
        if self.announced is not None:
            stackfile.remove(self.state_dir, self.announced)
            self.announced = None
        for child in reversed(self.children):
            child.stop(grace)
        for pid in processes_with_token(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def processes_with_token(token: str) -> list[int]:
    """Live processes started by this `llmgw up` (they inherit its token), this process excluded."""
    return pids_with_env(TOKEN_VAR, token)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def celery_argv(*args: str) -> list[str]:
    return python_module("celery", "-A", "workers", *args)


def wait_for(pred: Callable[[], bool], timeout: float, stop: Callable[[], bool], interval: float = 0.2) -> bool:
    """Poll `pred` until true, the timeout passes, or `stop()` says to give up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop():
        try:
            if pred():
                return True
        except Exception:  # noqa: BLE001 - the thing waited for may not be up yet
            pass
        time.sleep(interval)
    return False
