"""The process table, read from /proc: who a pid is, whether it is still the process we started, and
which processes carry a marker in their environment. One implementation for the node agent, `llmgw up`
(localstack) and the test harness's leak detector.

PIDs are reused, so a process is identified by (pid, start time in clock ticks from
`/proc/<pid>/stat` field 22) plus a marker we put there ourselves: the replica id in the shim's command
line, and `LLMGW_REPLICA_ID=<id>` in the environment of the shim and everything it starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

REPLICA_ENV = "LLMGW_REPLICA_ID"
ATTEMPT_ENV = "LLMGW_REPLICA_ATTEMPT"


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    state: str  # one letter: R, S, D, Z (zombie: exited, not yet reaped), ...
    ppid: int
    pgrp: int
    start_ticks: int  # field 22: start time since boot in clock ticks
    cmdline: tuple[str, ...]

    @property
    def exited(self) -> bool:
        return self.state in ("Z", "X", "x")


class Stat(NamedTuple):
    """The fields of /proc/<pid>/stat llmgw reads (as ProcInfo's)."""

    state: str
    ppid: int
    pgrp: int
    start_ticks: int


def parse_stat(text: str) -> Stat:
    """The fields llmgw reads from the text of /proc/<pid>/stat.

    The command name (field 2) is in parentheses and may itself contain spaces and ')', so split on
    the last ')'."""
    rest = text.rsplit(")", 1)[1].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    return Stat(rest[0], int(rest[1]), int(rest[2]), int(rest[19]))


def read_proc(pid: int, proc_root: Path = Path("/proc")) -> ProcInfo | None:
    """The process with this pid now, or None if there is none (or it is unreadable)."""
    if pid <= 0:
        return None
    base = proc_root / str(pid)
    try:
        state, ppid, pgrp, start = parse_stat((base / "stat").read_text())
        raw = (base / "cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return None
    cmd = tuple(p.decode(errors="replace") for p in raw.split(b"\0") if p)
    return ProcInfo(pid, state, ppid, pgrp, start, cmd)


def read_environ(pid: int, proc_root: Path = Path("/proc")) -> dict[str, str]:
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def start_ticks(pid: int) -> int | None:
    info = read_proc(pid)
    return info.start_ticks if info else None


def is_same_process(
    pid: int | None, pid_start: int | None, replica_id: str, proc_root: Path = Path("/proc")
) -> bool:
    """True if `pid` is alive (not a zombie), started at `pid_start`, and its command line names
    `replica_id` as one argument (`--replica <id>`; an exact match, so `r-1` is not `r-10`). Never
    trusts the pid alone: a reused pid fails the start-time or command check."""
    if not pid or pid_start is None:
        return False
    info = read_proc(pid, proc_root)
    if info is None or info.exited or info.start_ticks != pid_start:
        return False
    return replica_id in info.cmdline


def group_members(pgid: int, replica_id: str, proc_root: Path = Path("/proc")) -> list[int]:
    """Live processes of process group `pgid` that carry LLMGW_REPLICA_ID=replica_id.

    Used to clean up an engine whose shim is gone: the group id alone could in principle have been
    reused, the environment marker could not."""
    out = []
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        info = read_proc(int(entry), proc_root)
        if info is None or info.exited or info.pgrp != pgid:
            continue
        if read_environ(info.pid, proc_root).get(REPLICA_ENV) == replica_id:
            out.append(info.pid)
    return out


def pids_with_env(var: str, value: str, proc_root: Path = Path("/proc"), include_self: bool = False) -> list[int]:
    """Pids of live (non-zombie) processes whose environment carries `var=value` exactly.

    How `llmgw up` and the tests find every process they started, however deep: children inherit
    the marker. This process is left out unless `include_self`."""
    needle = f"{var}={value}".encode()
    me = os.getpid()
    found = []
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or (int(entry) == me and not include_self):
            continue
        try:
            env = (proc_root / entry / "environ").read_bytes()
            state = parse_stat((proc_root / entry / "stat").read_text()).state
        except (OSError, ValueError, IndexError):
            continue
        if needle in env.split(b"\0") and state not in ("Z", "X", "x"):
            found.append(int(entry))
    return sorted(found)


def describe(pid: int, proc_root: Path = Path("/proc")) -> str:
    """`pid: command line` (first 200 characters) for messages about stray processes."""
    try:
        cmd = (proc_root / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = "?"
    return f"{pid}: {cmd.strip()[:200]}"
