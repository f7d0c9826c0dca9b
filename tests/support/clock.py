"""The one fake clock of the tests, for code handed a clock (`time()`, `monotonic()`, `sleep()`) or a
bare `now` callable (pass `clock.time` or `clock.monotonic`)."""

from __future__ import annotations

import time


class FakeClock:
    """Time stands still until the test moves it: `advance(s)` (or `sleep(s)`) moves both clocks, and
    `t` (the wall clock) and `mono` may be moved on their own. With `real_monotonic`, monotonic time
    passes for real (queue timeouts inside the code under test) while the wall clock stands still (a
    rate-limit minute must not turn mid-test)."""

    def __init__(self, t: float = 1000.0, mono: float | None = None, real_monotonic: bool = False):
        self.t = t
        self.mono = t if mono is None else mono
        self.real_monotonic = real_monotonic

    def time(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return time.monotonic() if self.real_monotonic else self.mono

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.mono += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
