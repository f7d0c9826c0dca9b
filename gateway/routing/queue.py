"""The bounded per-model queue a standard request waits in while its model is saturated (or starting),
and the table of them (one per requested name: aliases have their own).

The waiter released next is the one of the tenant with the least service received
(gateway.routing.fairness, over the process's gateway.routing.ledger.Ledger), first come first served
within a tenant; with `LLMGW_GATEWAY_FAIRNESS=fcfs`, the oldest."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Collection, Iterator, Protocol

from gateway.routing.choice import Choice, Rejection
from gateway.routing.fairness import estimate, output_estimate, prompt_estimate
from gateway.routing.ledger import NO_TENANT, Backlog, Charge, Ledger
from llmgw.state.keypolicy import Tenant
from llmgw import surface as op

GONE = Rejection("client_gone", "", "the client closed its connection while the request waited")
RECHECK = 1.0  # seconds: the head re-routes at least this often, only a fallback for a missed wake
GENERATING = frozenset({op.CHAT, op.COMPLETIONS, op.RESPONSES})  # operations whose output is charged


DEFER = 0.05  # seconds a head that another worker's outranks sleeps before it looks again


# Across workers (Order.first), a head due within the urgent window publishes this plus its due time as its
# counter: it then ranks before every head that is not (a counter is never more than one of its key's
# requests below zero: gateway.routing.fairness.lifted), the least due first.
URGENT_COUNTER = -1e12


class Ticket:
    """One waiter: woken (`set`) when it should look again, by the event that may let it go."""

    __slots__ = ("event", "arrived", "due")

    def __init__(self, arrived: float = 0.0, due: float = math.inf):
        self.event = threading.Event()
        self.arrived = arrived
        self.due = due  # when its first byte is due (gateway.routing.slo.due; inf: no target)


class Order(Protocol):
    """The heads of the other workers' queues (gateway.server.board.Board): a head routes only when
    none of theirs for the same model ranks before it."""

    def publish_head(self, model: str, key: str, rank: int, counter: float, waiting: int, arrival: float,
                     now: float, queued: int = 1) -> None: ...

    def waiting_elsewhere(self, model: str, now: float) -> int: ...

    def drop_head(self, model: str) -> None: ...

    def first(self, model: str, key: str, rank: int, counter: float, waiting: int, arrival: float,
              now: float) -> bool: ...

    def elsewhere(self, model: str, key: str, now: float) -> tuple[bool, float | None]: ...


class WaitQueue:
    """A bounded queue of requests waiting for a model's endpoints to free, in fair order by tenant.

    Only the head (the waiter `Backlog.head` names: the tenant least served) tries to route, and
    only the head is woken: when a request on one of the model's endpoints ends, or new loads or a
    new endpoint list arrive (`notify`), and when the head before it leaves. The rest sleep until
    their turn or their deadline: nothing polls. A waiter woken that is no longer the head (a
    request sent since changed the counters) wakes the one that is. A deferral that expires with
    time (choice's "a faster endpoint frees sooner", `Rejection.retry_in`) is looked at again when
    it expires; `recheck` bounds the sleep only in case a wake was missed."""

    def __init__(self, max_len: int, recheck: float = RECHECK, monotonic: Callable[[], float] = time.monotonic,
                 entered: threading.Event | None = None, ledger: Ledger | None = None,
                 model: Callable[[], str] = lambda: "", order: Order | None = None, urgent: float = 1.0):
        self.max_len = max_len
        self.urgent = urgent  # a waiter due within this many seconds goes first (Backlog.head)
        self.recheck = recheck
        self.monotonic = monotonic
        self.lock = threading.Lock()
        self.waiters: Backlog[Ticket] = Backlog()
        self.entered = entered  # set when a request joins (WaitQueues.waiting)
        self.ledger = ledger if ledger is not None else Ledger()
        self.model = model  # the model whose counters order it (an alias's: its model's)
        self.order = order  # the sibling workers' heads (None: this worker alone)

    def __len__(self) -> int:
        return len(self.waiters)

    def head(self) -> Ticket | None:
        with self.lock:
            waiters = self.waiters
            if waiters.timed:
                return waiters.head(self.ledger, self.model(), self.monotonic(), self.urgent)
            return waiters.head(self.ledger, self.model())

    def elsewhere(self) -> int:
        """Requests for this queue's model waiting in the other workers' queues (0: none, or alone)."""
        order = self.order
        return order.waiting_elsewhere(self.model(), self.monotonic()) if order is not None else 0

    def position(self, tenant: Tenant | None, due: float = math.inf) -> int:
        """Where a new request of `tenant` would leave the queue (1 = next); `due`: when its first byte
        is due (Backlog.position)."""
        with self.lock:
            if due == math.inf:
                return self.waiters.position(tenant or NO_TENANT, self.ledger.fcfs)
            return self.waiters.position(tenant or NO_TENANT, self.ledger.fcfs, due, self.monotonic(), self.urgent)

    def notify(self) -> None:
        """Something that may free an endpoint happened: the head looks again."""
        if self.waiters:
            head = self.head()
            if head is not None:
                head.event.set()

    def wait(self, attempt: Callable[[], Choice | Rejection], timeout: float,
             keep: Collection[str] = ("saturated",), gone: Callable[[], bool] | None = None,
             watch: Callable[[Callable[[], None]], Callable[[], None] | None] | None = None,
             tenant: Tenant | None = None, head: bool = False, rank: int = 1,
             arrived: float | None = None, due: float = math.inf) -> Choice | Rejection | None:
        """Wait for a turn and an endpoint. Returns the Choice, a Rejection of a kind not in `keep`
        (the model went away), `GONE` when `gone()` says the client left, or None when the queue is
        full or the time ran out. A cold start keeps waiting while the model has no endpoint at all
        (gateway.routing.admission). `watch(wake)`, when given, arranges for `wake()` when the client
        may have left (gateway.request.client) and returns what cancels that. `tenant`: whom the
        request is served for (None: a FIFO of its own). `head`: it waits at the head of its tenant's
        FIFO and is never refused for a full queue (a continuation: admitted work). `rank`: its
        criticality class's (llmgw.state.keypolicy.PRIORITY_RANK): a higher class goes first. `arrived`:
        when its request arrived (monotonic; a continuation's is its request's), else now. `due`: when
        its first byte is due (monotonic; inf: it has no target): once within the urgent window, the
        least due goes first."""
        ticket = Ticket(self.monotonic() if arrived is None else arrived, due)
        tenant = tenant or NO_TENANT
        model = self.model()
        with self.lock:
            # Full for this tenant when its place in the fair order is past the bound: a tenant's
            # backlog fills the queue for itself, not for one that sends little (fcfs: the length).
            if not head and self.waiters.position(tenant, self.ledger.fcfs) > self.max_len:
                return None
            order = self.order
            there = (lambda key: order.elsewhere(model, key, ticket.arrived)) if order is not None else None
            self.waiters.push(tenant, ticket, self.ledger, model, front=head, rank=rank, due=due, elsewhere=there)
        if self.entered is not None:
            self.entered.set()
        event = ticket.event
        unwatch = watch(event.set) if watch is not None else None
        entered = self.monotonic()
        deadline = entered + timeout
        woken = False
        try:
            while True:
                event.clear()  # a wake from here on is not lost: it sets the event the wait below sees
                if gone is not None and gone():
                    return GONE
                sleep = None
                head = self.head()
                if head is ticket and not self._first_everywhere(ticket, tenant, rank, model):
                    sleep = DEFER  # another worker's head goes first: it takes the slot that frees
                elif head is ticket:
                    res = attempt()
                    if isinstance(res, Choice) or res.kind not in keep:
                        return res
                    sleep = min(self.recheck, res.retry_in) if res.retry_in else self.recheck
                elif woken and head is not None:
                    head.event.set()  # woken in its stead: the turn is the head's
                woken = True
                remaining = deadline - self.monotonic()
                if remaining <= 0:
                    return None
                event.wait(remaining if sleep is None else min(remaining, sleep))
        finally:
            if unwatch is not None:
                unwatch()
            with self.lock:
                self.waiters.remove(tenant, ticket)
                head = self.waiters.head(self.ledger, model, self.monotonic(), self.urgent)
            if head is not None:
                head.event.set()  # the next in line may take the next free slot
            elif self.order is not None:
                self.order.drop_head(model)
            self.ledger.waited(model, tenant, self.monotonic() - entered)


    def _first_everywhere(self, ticket: Ticket, tenant: Tenant, rank: int, model: str) -> bool:
        """Whether this head (published first) ranks before every other worker's head of the model."""
        order = self.order
        if order is None:
            return True
        now = self.monotonic()
        if ticket.due - now <= self.urgent:
            counter = URGENT_COUNTER + ticket.due  # before every head not due soon, the least due first
        else:
            counter = self.ledger.counter(model, tenant.key) if tenant.key else 0.0
        with self.lock:
            subs = self.waiters.fifos.get(tenant.key)
            waiting = sum(len(f) for f in subs.values()) if subs else 1
            queued = len(self.waiters)
        order.publish_head(model, tenant.key, rank, counter, waiting, ticket.arrived, now, queued)
        return order.first(model, tenant.key, rank, counter, waiting, ticket.arrived, now)


class WaitQueues:
    """Every model's queue, made on first use; only ever asked for names the tables know, so unknown
    names cost nothing. Iterating gives the names that have a queue. `model_of(name)` is the model a
    requested name is served by (an alias's, an adapter's base model): a slot freed on an endpoint of
    model M wakes only the queues of M's names."""

    def __init__(self, max_len: int, monotonic: Callable[[], float] = time.monotonic,
                 model_of: Callable[[str], str] = lambda name: name, recheck: float = RECHECK,
                 ledger: Ledger | None = None, order: Order | None = None, urgent: float = 1.0):
        self.max_len, self.monotonic, self.model_of, self.recheck = max_len, monotonic, model_of, recheck
        self.urgent = urgent  # LLMGW_GATEWAY_SLO_URGENT
        self.order = order  # the sibling workers' queue heads (gateway.server.board; None: alone)
        self.by_name: dict[str, WaitQueue] = {}
        self.lock = threading.Lock()
        self.waiting = threading.Event()  # set when a request joins any queue (cleared by a watcher)
        # The tenants' counters every queue is ordered by (gateway.server.fairshare shares them).
        self.ledger = ledger if ledger is not None else Ledger(monotonic=monotonic)

    def get(self, model: str) -> WaitQueue:
        q = self.by_name.get(model)
        if q is None:
            with self.lock:
                q = self.by_name.get(model)
                if q is None:
                    q = self.by_name[model] = WaitQueue(self.max_len, self.recheck, self.monotonic, self.waiting,
                                                        self.ledger, lambda: self.model_of(model), self.order,
                                                        self.urgent)
        return q

    def sent(self, call, plan, choice: Choice) -> Charge | None:
        """A request (gateway.request.call.Call, planned by gateway.request.plan.Plan) is sent with
        `choice`: charge its tenant the service it is expected to cost (gateway.routing.fairness.estimate).
        The Charge returned corrects it when its answer ends; the caller charges a request once (a retry
        is not charged again). Nothing without a tenant."""
        tenant = plan.tenant
        if tenant is None:
            return None
        model = self.model_of(call.model)
        body = call.body
        if body is not None:
            most = body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens")
        else:
            most = None
        led = self.ledger
        prompt = prompt_estimate(plan.prompt_tokens, len(call.data) if call.data else 0)
        output = output_estimate(most, led.expected_output(model, tenant.key), call.route.op in GENERATING)
        return led.sent(model, tenant, estimate(prompt, choice.matched, output, led.output_weight))

    def waiting_models(self) -> set[str]:
        """The models some request waits for here (their counters are read back at every exchange)."""
        return {self.model_of(name) for name, q in list(self.by_name.items()) if q.waiters}

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
