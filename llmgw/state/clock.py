"""The clock seam: the real wall and monotonic clocks, handed to whatever needs the time."""

from __future__ import annotations

import time


class Clock:
    """The real clock; tests pass a fake with the same two methods."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()
