"""Who gets in when a model is saturated: a pure `admit(...)` plus the bounded per-model wait queue.

A model is saturated when every one of its endpoints is (waiting >= max_waiting, KV >= max_kv, or
in-flight >= capacity). Then `sheddable` gets 429 at once, `standard` waits in a bounded FIFO queue
(length and time configurable) and is sent as soon as an endpoint frees, else 429 with Retry-After,
and `critical` is always sent (the router picks the least-loaded endpoint for it).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection

from gateway.routing import Choice, Rejection


@dataclass(frozen=True)
class Send:
    choice: Choice


@dataclass(frozen=True)
class Wait:
    """Join the model's queue (it is saturated, or others are already waiting ahead)."""


@dataclass(frozen=True)
class Shed:
    reason: str
    retry_after: int = 1


def admit(result: Choice | Rejection, priority: str, queue_len: int, queue_max: int, queue_timeout: float):
    """Decide for one routing result. Unknown-model / no-Ready rejections are not admission's business
    and are returned unchanged for the caller's error table."""
    if isinstance(result, Rejection) and result.kind != "saturated":
        return result
    if priority == "critical":
        # choose() never rejects critical traffic for saturation.
        return Send(result) if isinstance(result, Choice) else Shed("saturated", 1)
    if isinstance(result, Choice):
        # The router saw the queue (RouteRequest.queued): a Choice means an open endpoint serves this
        # request sooner than waiting behind the queued ones for a faster endpoint would.
        return Send(result)
    if priority == "sheddable":
        return Shed("model saturated; sheddable requests are rejected", 1)
    if queue_len >= queue_max or queue_timeout <= 0:
        return Shed("model saturated and its queue is full", max(1, math.ceil(queue_timeout)))
    return Wait()


class WaitQueue:
    """A bounded FIFO of requests waiting for a model's endpoints to free.

    Only the head of the queue tries to route (so queued requests keep their order); it is woken when
    a request of any model finishes (`notify`) and re-checks at least every `recheck` seconds, since
    fresh load figures also free endpoints."""

    def __init__(self, max_len: int, recheck: float = 0.05, monotonic: Callable[[], float] = time.monotonic):
        self.max_len = max_len
        self.recheck = recheck
        self.monotonic = monotonic
        self.cond = threading.Condition()
        self.waiters: deque[object] = deque()

    def __len__(self) -> int:
        return len(self.waiters)

    def notify(self) -> None:
        if self.waiters:
            with self.cond:
                self.cond.notify_all()

    def wait(self, attempt: Callable[[], Choice | Rejection], timeout: float,
             keep: Collection[str] = ("saturated",)) -> Choice | Rejection | None:
        """Wait for a turn and an endpoint. Returns the Choice, a Rejection of a kind not in `keep`
        (the model went away), or None when the queue is full or the time ran out. A cold start keeps
        waiting while the model has no endpoint at all (gateway.coldstart)."""
        with self.cond:
            if len(self.waiters) >= self.max_len:
                return None
            ticket = object()
            self.waiters.append(ticket)
            deadline = self.monotonic() + timeout
            try:
                while True:
                    if self.waiters[0] is ticket:
                        res = attempt()
                        if isinstance(res, Choice) or res.kind not in keep:
                            return res
                    remaining = deadline - self.monotonic()
                    if remaining <= 0:
                        return None
                    self.cond.wait(min(remaining, self.recheck))
            finally:
                self.waiters.remove(ticket)
                self.cond.notify_all()
