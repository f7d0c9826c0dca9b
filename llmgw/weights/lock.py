"""One writer per file on a node: an flock on an open lock file, which the kernel drops with the process.

A dead agent (even killed with -9) cannot leave the lock held; a restarted one takes it at once. Locks
are per open file description, so two threads of one process exclude each other as two processes do.
The lock file is never removed (a waiter and the holder must lock the same inode), which is also what
huggingface_hub's `filelock` does with the same files under `<cache>/.locks/`, so a download of ours
and an `hf_hub_download` of the same blob on the node exclude each other too.

Waiting polls a non-blocking flock so a waiter can report the holder's progress (read from the file
the holder writes) and give up when it is cancelled.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

POLL = 0.2


class Cancelled(Exception):
    """The wait for a lock was given up (the replica it was for stopped)."""


def try_lock(path: Path) -> int | None:
    """Take the lock at `path` if it is free: the open fd that holds it, or None when another holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        # Someone removed the file between our open and flock (a cache clean-up): lock the new one.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def release(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextmanager
def held(path: Path, *, cancel: threading.Event | None = None, on_wait: Callable[[], None] | None = None,
         poll: float = POLL, sleep: Callable[[float], object] = time.sleep) -> Iterator[None]:
    """Hold the lock at `path` for the block; while another holds it, call `on_wait` every `poll`
    seconds (a waiter reports the holder's progress there) and raise Cancelled once `cancel` is set."""
    while True:
        fd = try_lock(path)
        if fd is not None:
            break
        if cancel is not None and cancel.is_set():
            raise Cancelled(str(path))
        if on_wait is not None:
            on_wait()
        if cancel is not None:
            cancel.wait(poll)
        else:
            sleep(poll)
    try:
        yield
    finally:
        release(fd)
