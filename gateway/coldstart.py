"""Cold start: a request for a model scaled to zero is held until a replica is Ready.

A model can cold-start when one of its profiles autoscales with `min: 0` (the gateway reads that
from the applied catalog in its background loop: `GatewayState.cold_start`). When such a model has
no endpoint, `hold(...)` (pure) decides whether the request waits: it joins the model's wait queue,
counting against the queue's bound, for up to the model's `cold_start_timeout`. The wait itself is
the queue's: the request is sent as soon as the new replica is in the endpoint list (the pub/sub hint
wakes the gateway). Meanwhile `DemandSignal` tells the control plane at once: a small hint in Redis
(`llmgw:demand:<model>`, with a TTL) and a kick of the reconcile pass, so a replica is placed now,
not at the next timer tick; the gateway report's queued count carries the demand after that.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable

from gateway.admission import Shed
from llmgw.state.kicks import RECONCILE, Kicker
from llmgw.state.records import DemandHint
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

# The hint outlives a few report intervals; the reports (which carry the same queue) take over.
HINT_TTL = 10.0
# At most one hint and kick per model this often (seconds), however many requests arrive.
SIGNAL_EVERY = 1.0


@dataclass(frozen=True)
class Hold:
    """Wait in the model's queue up to `timeout` seconds for a replica to be Ready."""

    timeout: float


def hold(timeout: float, queue_len: int, queue_max: int) -> Hold | Shed:
    """A request for a model at zero replicas: wait for the cold start, unless its queue is full."""
    if queue_len >= queue_max:
        return Shed(f"the model is starting and {queue_len} requests already wait for it",
                    retry_after(timeout))
    return Hold(timeout)


def retry_after(timeout: float) -> int:
    """Seconds a client is told to wait before it retries a request the cold start did not serve."""
    return max(1, min(30, math.ceil(timeout / 6)))


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
