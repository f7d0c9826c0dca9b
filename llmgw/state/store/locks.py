"""Locks: one holder at a time per name (a pass of one kind, a catalog file apply), with a TTL so a
dead holder's lock expires."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import redis

from llmgw.state.store.base import Aggregate


class Locks(Aggregate):
    @contextmanager
    def lock(self, name: str, ttl: float) -> Iterator[bool]:
        """`with store.lock(key, ttl) as held:` -- one try, never waiting: held is False if another
        holder has it. redis-py's Lock: a token under `name` that expires after `ttl` seconds and is
        released only by its owner."""
        lock = self.r.lock(name, timeout=ttl, blocking=False)
        held = lock.acquire()
        try:
            yield held
        finally:
            if held:
                try:
                    lock.release()
                except redis.exceptions.LockError:
                    pass  # it expired (and may be another's now): nothing of ours left to release
