"""How other `llmgw` commands find the stack `llmgw up` runs: it keeps `stack.json` in its state dir
(its Redis URL, gateway URL, and who it is: pid and that pid's start time), replaced atomically, mode
0600 (the URL may carry a password), removed on a clean stop.

A file is trusted only while its `llmgw up` still runs (the same pid *and* start time: pids are
reused) and its Redis answers; anything else is ignored with a note saying why.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from llmgw import redisurl
from llmgw.proc.proctable import ProcInfo, read_proc
from llmgw.state.store import RedisError, Store, connect

STACK_FILE = "stack.json"


@dataclass(frozen=True)
class StackInfo:
    redis_url: str
    gateway_url: str
    pid: int  # of `llmgw up`
    pid_start: int  # that pid's start time in clock ticks (/proc/<pid>/stat field 22)
    started_at: float  # wall clock, for people

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> StackInfo:
        """Raises ValueError on anything but a file `write` made."""
        try:
            d = json.loads(text)
            info = cls(redis_url=str(d["redis_url"]), gateway_url=str(d["gateway_url"]), pid=int(d["pid"]),
                       pid_start=int(d["pid_start"]), started_at=float(d["started_at"]))
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise ValueError(f"not a stack file written by llmgw up ({type(e).__name__}: {e})") from None
        return info


@dataclass(frozen=True)
class Lookup:
    """What a search found: the live stack (and the state dir it is in), or None; the dirs searched;
    one note per stack file seen and ignored."""

    stack: StackInfo | None
    where: Path | None
    searched: tuple[Path, ...]
    notes: tuple[str, ...] = ()


def stack_path(state_dir: Path) -> Path:
    return Path(state_dir) / STACK_FILE


def write(state_dir: Path, info: StackInfo) -> Path:
    """Replace the stack file atomically (a reader sees the old file or the new one, never half)."""
    path = stack_path(state_dir)
    tmp = path.with_name(f".{STACK_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a leftover temporary file keeps its old mode through O_TRUNC
        os.write(fd, info.to_json().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def remove(state_dir: Path, info: StackInfo) -> None:
    """Remove the stack file if it still names this `llmgw up` (another one may have replaced it)."""
    path = stack_path(state_dir)
    try:
        current = StackInfo.from_json(path.read_text())
    except (OSError, ValueError):
        return
    if (current.pid, current.pid_start) == (info.pid, info.pid_start):
        path.unlink(missing_ok=True)


def stale_reason(info: StackInfo, proc: ProcInfo | None) -> str | None:
    """Why the `llmgw up` a stack file names no longer runs (None: it does). `proc` is the process
    that has its pid now, if any."""
    if proc is None or proc.exited:
        return f"llmgw up (pid {info.pid}) is not running"
    if proc.start_ticks != info.pid_start:
        return f"llmgw up (pid {info.pid}) is not running; that pid is another process now"
    return None


def masked(url: str) -> str:
    """The URL with its password replaced by `***`, for messages (a Sentinel URL's too)."""
    return redisurl.masked(url)


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    try:
        store = Store(connect(url, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=0))
        try:
            return store.ping()
        finally:
            store.close()
    except (RedisError, OSError, ValueError):
        return False


def running_stack(state_dir: Path, proc: Callable[[int], ProcInfo | None] | None = None
                  ) -> tuple[StackInfo | None, str | None]:
    """The stack file in `state_dir` and, if it is not trustworthy, why (a dead or reused pid, an
    unreadable file). (None, None): there is none."""
    proc = proc or read_proc
    path = stack_path(state_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"ignored {path}: cannot read it ({e.strerror or e})"
    try:
        info = StackInfo.from_json(text)
    except ValueError as e:
        return None, f"ignored {path}: {e}"
    why = stale_reason(info, proc(info.pid))
    return info, (f"ignored the stale {path}: {why}" if why else None)


def find_stack(dirs: Iterable[Path], proc: Callable[[int], ProcInfo | None] | None = None,
               answers: Callable[[str], bool] | None = None) -> Lookup:
    """The first live stack in `dirs` (searched in order, each once). `proc` and `answers` default
    to /proc and a PING."""
    proc, answers = proc or read_proc, answers or redis_answers
    searched: list[Path] = []
    notes: list[str] = []
    for d in dirs:
        d = Path(d).absolute()
        if d in searched:
            continue
        searched.append(d)
        info, why = running_stack(d, proc)
        if why:
            notes.append(why)
        elif info is not None and not answers(info.redis_url):
            notes.append(f"ignored {stack_path(d)}: llmgw up (pid {info.pid}) runs, but its Redis at "
                         f"{masked(info.redis_url)} does not answer")
        elif info is not None:
            return Lookup(info, d, tuple(searched), tuple(notes))
    return Lookup(None, None, tuple(searched), tuple(notes))
