"""`llmgw logs REPLICA [-f] [-n N]`: an engine's output.

On the machine that runs the replica, its log file (`<state_dir>/replicas/<id>/engine.log`, written
by the agent's shim) is read, and `-f` follows it across rotations. Elsewhere, the `log_tail` the agent
stored in the replica record (the end of the log when the engine last exited or stopped) is shown.
A unique prefix of a replica id is accepted.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from llmgw.cli.common import settings, store
from llmgw.errors import LlmgwError, NotFound, RedisUnreachable
from llmgw.state.store import RedisError


class LogsError(LlmgwError):
    pass


def register(sub) -> None:
    p = sub.add_parser("logs", help="show a replica engine's output")
    p.add_argument("replica", help="replica id (or a unique prefix of one)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output (local replicas)")
    p.add_argument("-n", "--lines", type=int, default=100, metavar="N", help="lines to show (default 100)")
    p.set_defaults(func=cmd_logs)


def _local_log(state_dir: Path, replica_id: str) -> Path | None:
    if not replica_id or "/" in replica_id or replica_id in (".", ".."):
        return None
    path = Path(state_dir) / "replicas" / replica_id / "engine.log"
    return path if path.exists() else None


def _resolve(s, prefix: str):
    """(replica id, record or None) for an exact id or a unique prefix."""
    rec = s.get_replica(prefix)
    if rec is not None:
        return prefix, rec
    matches = [r for r in s.all_replicas() if r.id.startswith(prefix)]
    if len(matches) == 1:
        return matches[0].id, matches[0]
    if len(matches) > 1:
        ids = ", ".join(sorted(r.id for r in matches)[:10])
        raise LogsError(f"replica prefix {prefix!r} is ambiguous: {ids}")
    raise NotFound("replica", prefix)


def _tail_lines(path: Path, n: int) -> list[str]:
    if n <= 0:
        return []
    try:
        size = path.stat().st_size
    except OSError:
        return []
    want = 8192
    while True:
        with open(path, "rb") as f:
            f.seek(max(0, size - want))
            data = f.read()
        lines = data.decode("utf-8", errors="replace").splitlines()
        if len(lines) > n or want >= size:
            return lines[-n:]
        want *= 2


def _follow(path: Path, out=sys.stdout, poll: float = 0.5, until=lambda: False) -> None:
    """Print what is appended to `path`; reopen it when the shim rotates it (until Ctrl-C)."""
    f = open(path, "rb")
    f.seek(0, os.SEEK_END)
    inode = os.fstat(f.fileno()).st_ino
    try:
        while not until():
            chunk = f.read(65536)
            if chunk:
                out.write(chunk.decode("utf-8", errors="replace"))
                out.flush()
                continue
            time.sleep(poll)
            try:
                st = path.stat()
            except OSError:
                continue
            if st.st_ino != inode or st.st_size < f.tell():
                rest = f.read()  # what was written just before the rotation
                if rest:
                    out.write(rest.decode("utf-8", errors="replace"))
                    out.flush()
                f.close()
                f = open(path, "rb")
                inode = os.fstat(f.fileno()).st_ino
    finally:
        f.close()


def cmd_logs(args) -> int:
    if args.lines < 0:
        raise LogsError("-n must not be negative")
    cfg = settings()
    path = _local_log(cfg.state_dir, args.replica)
    rec = None
    replica_id = args.replica
    if path is None:
        try:
            replica_id, rec = _resolve(store(cfg), args.replica)
        except RedisError as e:
            raise LogsError(f"no local log for {args.replica!r}, and {RedisUnreachable(cfg.redis_url, e)}") from e
        path = _local_log(cfg.state_dir, replica_id)
    if path is not None:
        for line in _tail_lines(path, args.lines):
            print(line)
        sys.stdout.flush()
        if args.follow:
            _follow(path)
        return 0
    # Not on this machine: the tail the agent stored.
    where = f"node {rec.node}" if rec and rec.node else "no node yet"
    tail = (rec.log_tail if rec else None) or ""
    if not tail:
        print(f"llmgw: replica {replica_id} runs on {where}; no output recorded yet "
              f"(run `llmgw logs {replica_id}` on that node for the live log)", file=sys.stderr)
        return 0
    print(f"(replica {replica_id} runs on {where}; showing the output its agent last recorded)", file=sys.stderr)
    for line in tail.splitlines()[-args.lines:] if args.lines else []:
        print(line)
    if args.follow:
        print("llmgw: -f works only on the replica's own node", file=sys.stderr)
        return 1
    return 0
