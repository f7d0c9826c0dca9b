"""The keys' service counters exchanged with the other gateway processes through Redis, off the request path.

Fair queueing (gateway.routing.fairness) orders a saturated model's queue by the service each key
received. Behind a load balancer one key's requests reach several gateways, and each gateway runs
several gunicorn workers, each with its own queue: counted alone, a key that spreads its requests
over two processes would be served by each as if it had received half of what it did. So every
`interval` (LLMGW_GATEWAY_SHARE_FAIRNESS, 0.05 s) each worker adds what it charged since its last
exchange to the model's totals in Redis and, in the same round trip, reads back the totals of the
models some request waits for here (llmgw.state.store.tenants). A key's counter, as any process
decides on it, is then exact for its own requests and at most about two intervals behind for the
others' (one until they add, one until this process reads), plus the round trip.

Every SHARES_EVERY it also reads the totals of every model it served, for the per-key share in
/metrics. A pass with nothing counted and nothing waiting costs nothing. When Redis fails, what was
counted stays pending here (the ledger keeps deciding on the last totals plus its own counts) and is
added on the next exchange that succeeds; the failure is logged once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from gateway.observe.health import REDIS_ERRORS
from gateway.routing.queue import WaitQueues
from llmgw.state.clock import Clock
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

SHARES_EVERY = 1.0  # seconds between reads of every served model's totals (the shares in /metrics)


class FairShare:
    def __init__(self, store: Store, queues: WaitQueues, clock: Clock, interval: float, metrics=None,
                 name_of: Callable[[str], str] = lambda key_id: key_id):
        self.store, self.queues, self.clock, self.metrics = store, queues, clock, metrics
        self.interval, self.name_of = interval, name_of
        self.stopping = threading.Event()
        self._shares_at = float("-inf")
        self._failing = False
        self._carry: dict[tuple[str, str], float] = {}  # tokens not yet shown: /metrics counters only grow

    def start(self) -> None:
        threading.Thread(target=self._loop, name="llmgw-fairshare", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()

    def _loop(self) -> None:
        # Counted alone (interval 0): the totals are still written, for the views, once a second.
        every = self.interval if self.interval > 0 else SHARES_EVERY
        while not self.stopping.wait(every):
            try:
                self.step()
                if self._failing:
                    log.info("exchanging the keys' service counters with Redis again")
                self._failing = False
            except REDIS_ERRORS as e:
                if not self._failing:  # once per outage: the pollers report Redis's health
                    log.warning("exchanging the keys' service counters with Redis failed: %s", e)
                self._failing = True
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("exchanging the keys' service counters failed")

    def step(self) -> int:
        """One exchange: add what was counted, read back what decisions and /metrics need. Returns how
        many (model, key) counts were added."""
        led = self.queues.ledger
        batch = led.take()
        now = self.clock.monotonic()
        read = self.queues.waiting_models() if self.interval > 0 else set()
        shares = now - self._shares_at >= SHARES_EVERY
        if shares:
            self._shares_at = now
            read |= set(led.models()) | {m for m, _ in batch}
        if not batch and not read:
            return 0
        totals = self.store.add_tenants(batch, int(self.clock.time() // 60), read)
        led.flushed(batch, totals, shared=self.interval > 0)
        if self.metrics is not None:
            self._show(batch, totals if shares else {})
        return len(batch)

    def _show(self, batch, totals) -> None:
        m, child = self.metrics, self.metrics.child
        names = self.queues.ledger.names
        for (model, kid), d in batch.items():
            name = names.get(kid) or self.name_of(kid)
            tokens = d.tokens + self._carry.pop((model, kid), 0.0)
            if tokens > 0:
                child(m.tenant_service, model, name).inc(tokens)
            elif tokens < 0:  # corrections beyond what was charged since: shown with the next charges
                self._carry[(model, kid)] = tokens
            if d.wait > 0:
                child(m.tenant_wait, model, name).inc(d.wait)
            if d.requests > 0:
                child(m.tenant_requests, model, name).inc(d.requests)
        for model in totals:
            for kid, share in self.queues.ledger.shares(model).items():
                child(m.tenant_share, model, names.get(kid) or self.name_of(kid)).set(share)
