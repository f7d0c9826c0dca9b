"""The bounded per-model FIFO a standard request waits in while its model is saturated (or starting),
and the table of them (one per requested name: aliases have their own)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Collection, Iterator

from gateway.routing.choice import Choice, Rejection


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
        waiting while the model has no endpoint at all (gateway.routing.coldstart)."""
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


class WaitQueues:
    """Every model's queue, made on first use; only ever asked for names the tables know, so unknown
    names cost nothing. Iterating gives the names that have a queue."""

    def __init__(self, max_len: int, monotonic: Callable[[], float] = time.monotonic):
        self.max_len, self.monotonic = max_len, monotonic
        self.by_name: dict[str, WaitQueue] = {}
        self.lock = threading.Lock()

    def get(self, model: str) -> WaitQueue:
        q = self.by_name.get(model)
        if q is None:
            with self.lock:
                q = self.by_name.setdefault(model, WaitQueue(self.max_len, monotonic=self.monotonic))
        return q

    def wake(self) -> None:
        """A request ended or the tables changed: the heads of the queues try again."""
        for q in list(self.by_name.values()):
            q.notify()

    def lengths(self) -> dict[str, int]:
        return {name: len(q) for name, q in list(self.by_name.items())}

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.by_name))

    def __len__(self) -> int:
        return len(self.by_name)
