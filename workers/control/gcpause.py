"""`paused_gc()`: the cyclic garbage collector off for a block, restored after (a process-wide switch,
so only shells use it, never the pure cores they call)."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused_gc() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
