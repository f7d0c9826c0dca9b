"""The batch lines this gateway process holds a slot for, by the feeder that sent them (its
`X-LLMGW-Feeder` header, workers.batch): the gateway report's `feeders`. A feeder takes its own lines
out of the endpoints' counts by this, not by how long it thinks a line takes to reach a gateway
(workers.batch.decide).

A line is counted here only while its slot is counted in the in-flight counts: it is taken after
the slot was reserved, and given back together with the slot, under this lock, which the report
holds while it copies both. So a report never counts a feeder's line that its endpoints' counts do
not (that would be room the feeder takes twice). Only batch lines take this lock: one uncontended
acquisition when a line is sent and one when it ends, nothing per chunk.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")

FEEDER_MAX = 64  # characters of a feeder's id kept (its lines are counted under this much of it)


def feeder_of(header: str | None) -> str:
    """The feeder a batch line names ("" none: not counted)."""
    return header.strip()[:FEEDER_MAX] if header else ""


class FeederLines:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def took(self, feeder: str) -> None:
        """A line of `feeder` holds a slot (reserved before this is called)."""
        with self.lock:
            self.counts[feeder] = self.counts.get(feeder, 0) + 1

    def give_back(self, feeder: str, release: Callable[[], bool]) -> None:
        """A line of `feeder` leaves: `release` gives its slot back, under this lock, and says whether
        it held one (a lease is released once, however often asked)."""
        with self.lock:
            if not release():
                return
            n = self.counts.get(feeder, 0) - 1
            if n > 0:
                self.counts[feeder] = n
            else:
                self.counts.pop(feeder, None)

    def read(self, facts: Callable[[], T]) -> tuple[dict[str, int], T]:
        """The lines by feeder and `facts()` (the in-flight counts' copy), at one instant."""
        with self.lock:
            return dict(self.counts), facts()
