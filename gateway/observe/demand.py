"""Demand for a model scaled to zero, told to the control plane at once (docs/autoscaling.md).

A request held for a cold start (gateway.routing.admission) writes a small hint in Redis
(`llmgw:demand:<model>`, with a TTL) and kicks the reconcile pass, so a replica is placed now, not at
the next timer tick; the gateway report's queued count carries the demand after that.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable

from llmgw.state.kicks import RECONCILE, Kicker
from llmgw.state.demand_records import DemandHint
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

# The hint outlives a few report intervals; the reports (which carry the same queue) take over.
HINT_TTL = 10.0
# At most one hint and kick per model this often (seconds), however many requests arrive.
SIGNAL_EVERY = 1.0


class DemandSignal:
    """Writes the cold-start hint and kicks the reconcile pass, off the request path (a thread, a
    greenlet under gevent) and at most once per model every SIGNAL_EVERY seconds. Never raises."""

    def __init__(self, store: Store, kicker: Callable[[], Kicker], time: Callable[[], float],
                 monotonic: Callable[[], float]):
        self.store, self._kicker, self.time, self.monotonic = store, kicker, time, monotonic
        self.kicker: Kicker | None = None  # made on first use: most gateways never need one
        self.last: dict[str, float] = {}
        self.lock = threading.Lock()

    def demand(self, model: str, queued: int) -> bool:
        """Requests wait for `model` (its canonical name); True if a signal was sent."""
        now = self.monotonic()
        with self.lock:
            if now - self.last.get(model, -math.inf) < SIGNAL_EVERY:
                return False
            self.last[model] = now
        threading.Thread(target=self._send, args=(model, queued, self.time()), name="llmgw-demand",
                         daemon=True).start()
        return True

    def _send(self, model: str, queued: int, at: float) -> None:
        try:
            self.store.write_demand_hint(model, DemandHint(at, queued), HINT_TTL)
        except Exception as e:  # noqa: BLE001 - the gateway report carries the demand as well
            log.warning("could not write the cold-start hint for %s: %s", model, e)
        try:
            if self.kicker is None:
                self.kicker = self._kicker()
            self.kicker.kick(RECONCILE)
        except Exception as e:  # noqa: BLE001 - the periodic reconcile pass reads the report anyway
            log.warning("could not kick a reconcile for %s: %s", model, e)
