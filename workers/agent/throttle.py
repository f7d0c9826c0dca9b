"""A warning about a repeated condition, logged at most once an interval (a pass runs every second)."""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("llmgw.agent")


class Warner:
    def __init__(self, monotonic: Callable[[], float]):
        self.monotonic = monotonic
        self._warned: dict[str, float] = {}

    def __call__(self, key: str, text: str, interval: float = 60.0) -> None:
        """Log `text` about replica `key` ("*": about the node) unless it was logged within `interval`."""
        now = self.monotonic()
        if now - self._warned.get(key + text, -1e18) >= interval:
            if len(self._warned) > 1000:
                self._warned.clear()
            self._warned[key + text] = now
            log.warning("%s", text if key == "*" else f"replica {key}: {text}")
