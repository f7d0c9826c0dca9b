"""What a request changes for fair queueing: the tenants' counters of one gateway process (`Ledger`), and
the waiters of one queue by tenant (`Backlog`). The decisions over them are gateway.routing.fairness's.

A key's counter on a model is what every gateway process flushed to Redis, as last read
(gateway.server.fairshare), plus what this process charged since its last flush, plus the lifts this
process made (a tenant joining its queue lifted to the others' floor). So a key that spreads its
requests over several gateways is counted whole by each of them, within one exchange interval.
Sub-tenants' counters stay in the process (the key's share is what is enforced fleet-wide; how a
front end's sub-tenants split it is judged per process).

The request path adds to dicts under one short lock (`sent`, `charge`, `waited`: microseconds, never
across I/O); the exchange loop takes what was counted (`take`) and hands back what Redis holds
(`flushed`).
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque
from typing import Callable, Generic, Iterable, Mapping, TypeVar

from gateway.routing.fairness import LEARN_OUTPUT, cost, fair_position, floor, learn_output, lifted, next_of, shares
from llmgw.state.keypolicy import Tenant
from llmgw.state.tenants import TenantDelta, TenantTotals

T = TypeVar("T")
# What the sibling workers say of a key joining a queue: whether they hold its requests (waiting or
# running), and the least counter of another key's head in their queues (None: none).
Elsewhere = Callable[[str], "tuple[bool, float | None]"]
NO_TENANT = Tenant("", "", 1.0, "")  # a waiter without a tenant (a cold start's): one FIFO of its own
SUB_IDLE = 600.0  # seconds after which a sub-tenant's counter is forgotten (one that returns is lifted)
SUBS_MAX = 50_000  # sub-tenant counters kept before idle ones are forgotten early
SHARE_WINDOW = 60.0  # seconds the shares in /metrics are taken over


class Charge:
    """What one request was charged when it was sent; `done` corrects it by what its answer reported."""

    __slots__ = ("ledger", "model", "tenant", "estimate", "open")

    def __init__(self, ledger: "Ledger", model: str, tenant: Tenant, estimate: float):
        self.ledger, self.model, self.tenant, self.estimate = ledger, model, tenant, estimate
        self.open = True  # its answer has not ended (the key is active: Ledger.idle)

    def done(self, usage) -> None:
        """The answer ended with `usage` (prompt, completion tokens, and `.cached` when the engine said;
        None: it said nothing, and the estimate stands)."""
        led = self.ledger
        if self.open:
            self.open = False
            led.ended(self.model, self.tenant)
        if not usage:
            return
        cached = getattr(usage, "cached", None) or 0
        actual = cost(usage[0] - cached, usage[1], led.output_weight)
        led.answered(self.model, self.tenant, actual - self.estimate, usage[1])


class Ledger:
    def __init__(self, output_weight: float = 2.0, fcfs: bool = False,
                 monotonic: Callable[[], float] = time.monotonic):
        self.output_weight, self.fcfs, self.monotonic = output_weight, fcfs, monotonic
        self.lock = threading.Lock()
        self.seen: dict[tuple[str, str], float] = {}  # (model, key) -> counter in Redis, as last read
        self.pending: dict[tuple[str, str], float] = {}  # (model, key) -> charged here, not flushed yet
        self.lifted: dict[tuple[str, str], float] = {}  # (model, key) -> what this process's lifts added
        self.subs: dict[tuple[str, str, str], list[float]] = {}  # (model, key, sub) -> [counter, last charged]
        self.last: dict = {}  # model -> key served last; (model, key) -> its sub-tenant served last
        self.outputs: dict[tuple[str, str], float] = {}  # (model, key) -> expected output tokens
        self.turns: dict[tuple[str, str], float] = {}  # (model, key) -> what one of its requests costs (tokens)
        self.active: dict[tuple[str, str], int] = {}  # (model, key) -> its requests sent here, not ended
        self.names: dict[str, str] = {}  # key id -> name (the metrics' label)
        # (model, key) -> [tokens, wait seconds, requests] counted here and not flushed yet
        self.stats: dict[tuple[str, str], list[float]] = {}
        self.history: dict[str, deque[tuple[float, dict[str, float]]]] = {}  # model -> readings of tokens

    # --- what decisions read ------------------------------------------------------------------------
    def counter(self, model: str, key: str) -> float:
        k = (model, key)
        return self.seen.get(k, 0.0) + self.pending.get(k, 0.0) + self.lifted.get(k, 0.0)

    def sub_counter(self, model: str, key: str, sub: str) -> float:
        s = self.subs.get((model, key, sub))
        return s[0] if s is not None else 0.0

    def expected_output(self, model: str, key: str) -> float | None:
        return self.outputs.get((model, key))

    # --- a tenant joins a queue with nothing waiting there ----------------------------------------
    def idle(self, model: str, key: str) -> bool:
        """Whether no request of the key sent by this process is running on the model."""
        return not self.active.get((model, key))

    def join(self, model: str, tenant: Tenant, waiting_keys: Iterable[str], idle: bool = False,
             elsewhere: float | None = None) -> None:
        """Lift the key to the least counter of the keys waiting (else to the key served last), less
        one of its requests (fairness.lifted); `idle`: it has nothing waiting or running anywhere in the
        gateway, and may be taken back down to that level from within one request of it. `elsewhere`:
        the least counter of another key's head in the sibling workers' queues (their view of it, which
        may lag this one's by the charges not exchanged yet): a key lifted above it would rank after it."""
        last = self.last.get(model)
        others = [k for k in waiting_keys if k != tenant.key] or ([last] if last is not None and last != tenant.key
                                                                   else [])
        own = floor((self.counter(model, k) for k in waiting_keys if k != tenant.key),
                    self.counter(model, last) if last is not None and last != tenant.key else None)
        to = own if elsewhere is None else elsewhere if own is None else min(own, elsewhere)
        now = self.counter(model, tenant.key)
        # one of its requests; before it sent any, one of the others' (its own is not known yet)
        turn = self.turns.get((model, tenant.key))
        if turn is None:
            turn = max((self.turns.get((model, k), 0.0) for k in others), default=0.0)
        gap = lifted(now, to, turn / tenant.weight, idle, own) - now
        if gap:
            with self.lock:
                k = (model, tenant.key)
                self.lifted[k] = self.lifted.get(k, 0.0) + gap

    def join_sub(self, model: str, tenant: Tenant, waiting_subs: Iterable[str]) -> None:
        """The same among the sub-tenants of one key."""
        last = self.last.get((model, tenant.key))
        to = floor((self.sub_counter(model, tenant.key, s) for s in waiting_subs if s != tenant.sub),
                   self.sub_counter(model, tenant.key, last) if last is not None and last != tenant.sub else None)
        now = self.sub_counter(model, tenant.key, tenant.sub)
        new = lifted(now, to, self.turns.get((model, tenant.key), 0.0))
        if new > now:
            with self.lock:
                s = self.subs.setdefault((model, tenant.key, tenant.sub), [0.0, self.monotonic()])
                s[0] = new

    # --- the request path ---------------------------------------------------------------------------
    def sent(self, model: str, tenant: Tenant, estimate: float) -> Charge:
        """A request of `tenant` was sent, expected to cost `estimate`: charge it now."""
        with self.lock:
            self.last[model] = tenant.key
            if tenant.sub:
                self.last[(model, tenant.key)] = tenant.sub
            self._charge(model, tenant, estimate, 1)
            k = (model, tenant.key)
            self.active[k] = self.active.get(k, 0) + 1
            turn = self.turns.get(k)
            self.turns[k] = estimate if turn is None else turn + LEARN_OUTPUT * (estimate - turn)
        return Charge(self, model, tenant, estimate)

    def ended(self, model: str, tenant: Tenant) -> None:
        """A request of `tenant` sent by this process ended (answered or not)."""
        with self.lock:
            k = (model, tenant.key)
            n = self.active.get(k, 0) - 1
            if n > 0:
                self.active[k] = n
            else:
                self.active.pop(k, None)

    def answered(self, model: str, tenant: Tenant, correction: float, generated: int) -> None:
        """An answer ended: charge what it cost beyond its estimate (or give back what it did not),
        and learn how much its tenant's requests generate."""
        with self.lock:
            self._charge(model, tenant, correction, 0)
            k = (model, tenant.key)
            self.outputs[k] = learn_output(self.outputs.get(k), generated)

    def waited(self, model: str, tenant: Tenant, seconds: float) -> None:
        """A request of `tenant` left the queue after `seconds` (sent or not)."""
        with self.lock:
            st = self.stats.get((model, tenant.key))
            if st is None:
                st = self.stats[(model, tenant.key)] = [0.0, 0.0, 0]
                self.names[tenant.key] = tenant.name
            st[1] += seconds

    def _charge(self, model: str, tenant: Tenant, tokens: float, requests: int) -> None:
        k = (model, tenant.key)
        self.pending[k] = self.pending.get(k, 0.0) + tokens / tenant.weight
        st = self.stats.get(k)
        if st is None:
            st = self.stats[k] = [0.0, 0.0, 0]
            self.names[tenant.key] = tenant.name
        st[0] += tokens
        st[2] += requests
        if tenant.sub:
            s = self.subs.get((model, tenant.key, tenant.sub))
            if s is None:
                s = self.subs[(model, tenant.key, tenant.sub)] = [0.0, 0.0]
            s[0] += tokens
            s[1] = self.monotonic()

    # --- the exchange (gateway.server.fairshare) ----------------------------------------------------
    def take(self) -> dict[tuple[str, str], TenantDelta]:
        """What was counted here since the last flush, per (model, key); it stays counted here until
        `flushed` says Redis holds it."""
        with self.lock:
            keys = set(self.pending) | set(self.stats)
            out = {}
            for k in keys:
                st = self.stats.get(k) or (0.0, 0.0, 0)
                d = TenantDelta(self.pending.get(k, 0.0), st[0], st[1], int(st[2]))
                if d.service or d.tokens or d.wait or d.requests:
                    out[k] = d
            if len(self.subs) > SUBS_MAX:
                self._forget_subs(self.monotonic())
            return out

    def flushed(self, batch: Mapping[tuple[str, str], TenantDelta],
                read: Mapping[str, Mapping[str, TenantTotals]], shared: bool = True) -> None:
        """`batch` (from `take`) is in Redis, and `read` is what Redis held per model right after:
        every process's flushes, this one's included. Not `shared` (LLMGW_GATEWAY_SHARE_FAIRNESS=0),
        the totals read only feed the shares: the counters stay this process's own."""
        now = self.monotonic()
        with self.lock:
            for k, d in batch.items():
                left = self.pending.get(k, 0.0) - d.service
                if abs(left) > 1e-9:
                    self.pending[k] = left
                else:
                    self.pending.pop(k, None)
                st = self.stats.get(k)
                if st is not None:
                    st[0] -= d.tokens
                    st[1] -= d.wait
                    st[2] -= d.requests
                    if not st[2] and abs(st[0]) < 1e-9 and abs(st[1]) < 1e-9:
                        del self.stats[k]
                if k[0] not in read or not shared:  # not read back: what we flushed is ours to add
                    self.seen[k] = self.seen.get(k, 0.0) + d.service
            for model, totals in read.items():
                if shared:
                    for k in [k for k in self.seen if k[0] == model and k[1] not in totals]:
                        del self.seen[k]  # Redis lost it: counted from zero again, as every process will
                    for key, tot in totals.items():
                        self.seen[(model, key)] = tot.service
                h = self.history.get(model)
                if h is None:
                    h = self.history[model] = deque()
                h.append((now, {key: tot.tokens for key, tot in totals.items()}))
                while len(h) > 2 and h[1][0] <= now - SHARE_WINDOW:
                    h.popleft()

    def shares(self, model: str) -> dict[str, float]:
        """Each key's share of the model's service over the last SHARE_WINDOW seconds, as read from
        Redis (every gateway's)."""
        h = self.history.get(model)
        if not h:
            return {}
        return shares(h[0][1] if len(h) > 1 else {}, h[-1][1])  # one reading: since the totals began

    def models(self) -> list[str]:
        """The models this process counted service on (or read counters of)."""
        with self.lock:
            return sorted({k[0] for k in (*self.seen, *self.pending)})

    def _forget_subs(self, now: float) -> None:
        for k in [k for k, s in self.subs.items() if now - s[1] > SUB_IDLE]:
            del self.subs[k]


class Backlog(Generic[T]):
    """The waiters of one queue, a FIFO per tenant (key, then sub-tenant); `head` is who goes next: the
    waiters of the highest criticality class first (a FIFO's class is its first waiter's: a continuation
    of a batch line waits behind an interactive request it was evicted for), then
    gateway.routing.fairness.next_of over the ledger's counters. A waiter with a latency target has a
    `due` time (gateway.routing.slo.due): once the least due of them is within `urgent` seconds, it goes
    first, the least slack first; fair share decides while every waiter has more. Callers hold the
    queue's lock."""

    __slots__ = ("fifos", "weights", "n", "seq", "dues", "timed")

    def __init__(self) -> None:
        # key -> sub -> (arrival number, waiter, class rank: llmgw.state.keypolicy.PRIORITY_RANK)
        self.fifos: dict[str, dict[str, deque[tuple[int, T, int]]]] = {}
        self.weights: dict[str, float] = {}  # key -> its weight, while it has waiters
        self.n = 0
        self.seq = 0
        # The waiters with a due time: a heap of (due, arrival number, class rank, waiter), and each
        # one's due by id while it waits (an entry whose waiter left is dropped when it reaches the top).
        self.dues: list[tuple[float, int, int, T]] = []
        self.timed: dict[int, float] = {}

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def push(self, tenant: Tenant, item: T, ledger: Ledger, model: str, front: bool = False, rank: int = 1,
             due: float = math.inf, elsewhere: "Elsewhere | None" = None) -> None:
        """`front`: at the head of its tenant's FIFO, as the oldest (a continuation: work admitted before).
        `rank`: its criticality class's. `due`: when its first byte is due (inf: no target).
        `elsewhere`: what the sibling workers' queues and answers say of the key (None: there are none);
        with nothing of it there nor here, a joining key is idle (`Ledger.join`)."""
        subs = self.fifos.get(tenant.key)
        if subs is None:
            busy, least = elsewhere(tenant.key) if elsewhere is not None else (False, None)
            ledger.join(model, tenant, self.fifos, not front and not busy and ledger.idle(model, tenant.key), least)
            subs = self.fifos[tenant.key] = {}
            self.weights[tenant.key] = tenant.weight
        fifo = subs.get(tenant.sub)
        if fifo is None:
            if subs:
                ledger.join_sub(model, tenant, subs)
            fifo = subs[tenant.sub] = deque()
        self.seq += 1
        if front:
            fifo.appendleft((min(fifo[0][0], 0) - 1 if fifo else -self.seq, item, rank))
        else:
            fifo.append((self.seq, item, rank))
        self.n += 1
        if due != math.inf:
            heapq.heappush(self.dues, (due, self.seq, rank, item))
            self.timed[id(item)] = due

    def remove(self, tenant: Tenant, item: T) -> None:
        subs = self.fifos[tenant.key]
        fifo = subs[tenant.sub]
        if fifo[0][1] is item:
            fifo.popleft()
        else:
            for i, entry in enumerate(fifo):
                if entry[1] is item:
                    del fifo[i]
                    break
        self.n -= 1
        if self.timed:
            self.timed.pop(id(item), None)
            if not self.timed:
                self.dues.clear()
        if not fifo:
            del subs[tenant.sub]
            if not subs:
                del self.fifos[tenant.key]
                del self.weights[tenant.key]

    def urgent(self, now: float, within: float) -> T | None:
        """The waiter with the least due, when it is due within `within` seconds of `now` and no waiter
        of a higher class waits (else None: the fair order decides)."""
        dues, timed = self.dues, self.timed
        while dues and timed.get(id(dues[0][3])) != dues[0][0]:
            heapq.heappop(dues)  # (its waiter left)
        if not dues or dues[0][0] - now > within:
            return None
        rank = dues[0][2]
        if any(f[0][2] > rank for subs in self.fifos.values() for f in subs.values()):
            return None
        return dues[0][3]

    def head(self, ledger: Ledger, model: str, now: float | None = None, within: float = 0.0) -> T | None:
        """The waiter that goes next (`now`: the clock of the waiters' due times; None: no waiter is due)."""
        fifos = self.fifos
        if not fifos:
            return None
        if self.timed and now is not None:
            first = self.urgent(now, within)
            if first is not None:
                return first
        fcfs = ledger.fcfs
        if len(fifos) == 1:
            subs = next(iter(fifos.values()))
            key = None
        else:
            top = max(f[0][2] for subs in fifos.values() for f in subs.values())
            key = next_of(((k, ledger.counter(model, k), sum(len(f) for f in subs.values()),
                            min(f[0][0] for f in subs.values())) for k, subs in fifos.items()
                           if any(f[0][2] == top for f in subs.values())), fcfs)
            subs = fifos[key]
        if len(subs) == 1:
            return next(iter(subs.values()))[0][1]
        if key is None:
            key = next(iter(fifos))
        top = max(f[0][2] for f in subs.values())
        sub = next_of(((s, ledger.sub_counter(model, key, s), len(f), f[0][0]) for s, f in subs.items()
                       if f[0][2] == top), fcfs)
        return subs[sub][0][1]

    def position(self, tenant: Tenant, fcfs: bool, due: float = math.inf, now: float = 0.0,
                 within: float = 0.0) -> int:
        """Where a new request of `tenant` would leave the queue (fairness.fair_position); one due within
        `within` seconds of `now` leaves after the waiters due before it."""
        if due - now <= within:
            return 1 + sum(d <= due for d in self.timed.values())
        subs = self.fifos.get(tenant.key)
        own = sum(len(f) for f in subs.values()) if subs else 0
        others = (w for k, w in self.weights.items() if k != tenant.key)
        return fair_position(own, tenant.weight, others, self.n, fcfs)
