"""Whether this gateway process reaches Redis: shown by /healthz and a metric, logged once per outage.

When Redis cannot be reached the last tables stay in use (static stability) and every loop retries by
itself; each part that reads or writes Redis reports here (`failed`, `succeeded`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from llmgw.state.clock import Clock
from llmgw.state.store import RedisError

log = logging.getLogger("llmgw.gateway")

REDIS_ERRORS = (RedisError, OSError)


class RedisHealth:
    """Tracks whether Redis answers; logs each transition once (not per failed call)."""

    def __init__(self, clock: Clock, on_change: Callable[[bool], None] = lambda ok: None):
        self.clock = clock
        self.ok = True
        self.down_since: float | None = None
        self.last_error = ""
        self.on_change = on_change
        self._lock = threading.Lock()

    def failed(self, err: BaseException) -> None:
        with self._lock:
            self.last_error = f"{type(err).__name__}: {err}"
            if self.ok:
                self.ok = False
                self.down_since = self.clock.time()
                log.warning("redis unavailable (%s); serving from the last endpoint list", self.last_error)
                self.on_change(False)

    def succeeded(self) -> None:
        if self.ok:
            return
        with self._lock:
            if not self.ok:
                down = self.clock.time() - (self.down_since or self.clock.time())
                self.ok, self.down_since = True, None
                log.warning("redis reachable again after %.1fs", down)
                self.on_change(True)
