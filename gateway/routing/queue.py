"""The bounded per-model FIFO a standard request waits in while its model is saturated (or starting),
and the table of them (one per requested name: aliases have their own)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Collection, Iterator

from gateway.routing.choice import Choice, Rejection

GONE = Rejection("client_gone", "", "the client closed its connection while the request waited")
RECHECK = 1.0  # seconds: the head re-routes at least this often, only a fallback for a missed wake


class Ticket:
    """One waiter: woken (`set`) when it should look again, by the event that may let it go."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = threading.Event()


class WaitQueue:
    """A bounded FIFO of requests waiting for a model's endpoints to free.

    Only the head tries to route (queued requests keep their order), and only the head is woken:
    when a request on one of the model's endpoints ends, or new loads or a new endpoint list arrive
    (`notify`), and when the head before it leaves. The rest sleep until their turn or their
    deadline: nothing polls. A deferral that expires with time (choice's "a faster endpoint frees
    sooner", `Rejection.retry_in`) is looked at again when it expires; `recheck` bounds the sleep
    only in case a wake was missed."""

    def __init__(self, max_len: int, recheck: float = RECHECK, monotonic: Callable[[], float] = time.monotonic,
                 entered: threading.Event | None = None):
        self.max_len = max_len
        self.recheck = recheck
        self.monotonic = monotonic
        self.lock = threading.Lock()
        self.waiters: deque[Ticket] = deque()
        self.entered = entered  # set when a request joins (WaitQueues.waiting)

    def __len__(self) -> int:
        return len(self.waiters)

    def notify(self) -> None:
        """Something that may free an endpoint happened: the head looks again."""
        if self.waiters:
            with self.lock:
                if self.waiters:
                    self.waiters[0].event.set()

    def wait(self, attempt: Callable[[], Choice | Rejection], timeout: float,
             keep: Collection[str] = ("saturated",), gone: Callable[[], bool] | None = None,
             watch: Callable[[Callable[[], None]], Callable[[], None] | None] | None = None
             ) -> Choice | Rejection | None:
        """Wait for a turn and an endpoint. Returns the Choice, a Rejection of a kind not in `keep`
        (the model went away), `GONE` when `gone()` says the client left, or None when the queue is
        full or the time ran out. A cold start keeps waiting while the model has no endpoint at all
        (gateway.routing.admission). `watch(wake)`, when given, arranges for `wake()` when the client
        may have left (gateway.request.client) and returns what cancels that."""
        ticket = Ticket()
        with self.lock:
            if len(self.waiters) >= self.max_len:
                return None
            self.waiters.append(ticket)
        if self.entered is not None:
            self.entered.set()
        event = ticket.event
        unwatch = watch(event.set) if watch is not None else None
        deadline = self.monotonic() + timeout
        try:
            while True:
                event.clear()  # a wake from here on is not lost: it sets the event the wait below sees
                if gone is not None and gone():
                    return GONE
                sleep = None
                if self.waiters[0] is ticket:
                    res = attempt()
                    if isinstance(res, Choice) or res.kind not in keep:
                        return res
                    sleep = min(self.recheck, res.retry_in) if res.retry_in else self.recheck
                remaining = deadline - self.monotonic()
                if remaining <= 0:
                    return None
                event.wait(remaining if sleep is None else min(remaining, sleep))
        finally:
            if unwatch is not None:
                unwatch()
            with self.lock:
                head = self.waiters[0] is ticket
                self.waiters.remove(ticket)
                if head and self.waiters:
                    self.waiters[0].event.set()  # the next in line may take the next free slot


class WaitQueues:
    """Every model's queue, made on first use; only ever asked for names the tables know, so unknown
    names cost nothing. Iterating gives the names that have a queue. `model_of(name)` is the model a
    requested name is served by (an alias's, an adapter's base model): a slot freed on an endpoint of
    model M wakes only the queues of M's names."""

    def __init__(self, max_len: int, monotonic: Callable[[], float] = time.monotonic,
                 model_of: Callable[[str], str] = lambda name: name, recheck: float = RECHECK):
        self.max_len, self.monotonic, self.model_of, self.recheck = max_len, monotonic, model_of, recheck
        self.by_name: dict[str, WaitQueue] = {}
        self.lock = threading.Lock()
        self.waiting = threading.Event()  # set when a request joins any queue (cleared by a watcher)

    def get(self, model: str) -> WaitQueue:
        q = self.by_name.get(model)
        if q is None:
            with self.lock:
                q = self.by_name.setdefault(model, WaitQueue(self.max_len, self.recheck, self.monotonic,
                                                             self.waiting))
        return q

    def busy(self) -> bool:
        """Some request waits in some queue."""
        return any(q.waiters for q in list(self.by_name.values()))

    def wake(self, model: str | None = None) -> None:
        """A request of `model` ended (None: the loads or the tables changed, which may free any
        endpoint): the heads of its queues try again."""
        for name, q in list(self.by_name.items()):
            if q.waiters and (model is None or self.model_of(name) == model):
                q.notify()

    def lengths(self) -> dict[str, int]:
        return {name: len(q) for name, q in list(self.by_name.items())}

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.by_name))

    def __len__(self) -> int:
        return len(self.by_name)
