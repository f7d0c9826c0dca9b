"""What this gateway sent where, exchanged with the other gateways through Redis, off the request path.

Behind an L4 load balancer the turns of one conversation reach different gateways. Each gateway's
prefix index knows only what it sent (its gunicorn workers share theirs in memory,
gateway.server.sentlog), so a turn that reaches another gateway than its previous one finds no
endpoint holding its history there and is placed by its system prompt's head alone: on
bench/prefix.py with two gateways behind round robin, 141 of 366 later turns moved engine and the
fleet kept 76 % of prompt tokens cached against 83 % with one gateway (docs/gateway.md).

A conversation's next turn comes a think time after the last answer, seconds rather than
milliseconds, so the gateways need not agree per request (a round trip on every decision): every
`interval` each worker appends what it sent since its last flush to the stream `llmgw:sends`
(llmgw.state.store.sends) and reads what the other gateways appended since its last read, into its
router's prefix index and prefill backlog (Router.learn_sends). A send reaches the other gateways
within about one interval. A gateway that starts reads the stream from its beginning, the last
KEEP seconds of the fleet's sends, so it routes a conversation that is under way as the others do.
When Redis fails, the sends of that pass are dropped (stale by the next one) and the loop goes on.
"""

from __future__ import annotations

import logging
import threading

from gateway.observe.health import REDIS_ERRORS
from gateway.routing.router import Router
from llmgw.state.clock import Clock
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

# Seconds of sends the stream keeps (trimmed as it is written): what a starting gateway learns from.
# A turn after a longer pause is placed by its head's hash, as the gateways agree on without sharing.
KEEP = 120.0
READ_BATCH = 500  # entries per read; a pass reads on until the stream is drained or READS_PER_PASS
READS_PER_PASS = 20


class SendShare:
    def __init__(self, store: Store, router: Router, clock: Clock, interval: float, origin: str, metrics=None):
        self.store, self.router, self.clock, self.metrics = store, router, clock, metrics
        self.interval, self.origin = interval, origin
        self.cursor = "0-0"  # the stream position read up to (its beginning: all it keeps)
        self.stopping = threading.Event()
        self._failing = False

    def start(self) -> None:
        if self.interval <= 0:
            return
        self.router.share_sends()
        threading.Thread(target=self._loop, name="llmgw-sendshare", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()

    def _loop(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.step()
                self._failing = False
            except REDIS_ERRORS as e:
                if not self._failing:  # once per outage: the pollers report Redis's health
                    log.warning("sharing sends with the other gateways failed: %s", e)
                self._failing = True
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("sharing sends with the other gateways failed")

    def step(self) -> int:
        """One pass: publish ours, learn the others'. Returns how many of theirs were learned."""
        ours = self.router.take_sends()
        if ours:
            self.store.add_sends(self.origin, ours, self.clock.time(), KEEP)
        learned = 0
        for _ in range(READS_PER_PASS):
            self.cursor, read, theirs = self.store.sends_after(self.cursor, self.origin, READ_BATCH)
            self.router.learn_sends(theirs)
            learned += len(theirs)
            if read < READ_BATCH:
                break
        if self.metrics is not None:
            if ours:
                self.metrics.child(self.metrics.sends_shared, "published").inc(len(ours))
            if learned:
                self.metrics.child(self.metrics.sends_shared, "learned").inc(learned)
        return learned
