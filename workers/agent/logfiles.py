"""Where a replica's files live on its node (`llmgw logs` reads the same layout), and reading the end
of a log without reading it all."""

from __future__ import annotations

import os
import re
from pathlib import Path

_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


def replica_dir(state_dir: Path, replica_id: str) -> Path:
    """`<state_dir>/replicas/<id>`; refuses ids that could escape the directory."""
    if not _SAFE.match(replica_id) or replica_id in (".", ".."):
        raise ValueError(f"unsafe replica id {replica_id!r}")
    return Path(state_dir) / "replicas" / replica_id


def tail_bytes(path: Path, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read()
    except OSError:
        return b""


def tail_text(path: Path, max_bytes: int = 4000) -> str:
    """The last `max_bytes` of a log, starting at a line boundary when it was cut."""
    data = tail_bytes(path, max_bytes)
    text = data.decode("utf-8", errors="replace")
    if len(data) >= max_bytes and "\n" in text:
        text = text.split("\n", 1)[1]
    return text
