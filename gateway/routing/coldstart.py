"""Cold start: a request for a model scaled to zero is held until a replica is Ready.

A model can cold-start when one of its profiles autoscales with `min: 0` (the gateway reads that
from the applied catalog in its background loop: `Tables.cold_start`). When such a model has
no endpoint, `hold(...)` (pure) decides whether the request waits: it joins the model's wait queue,
counting against the queue's bound, for up to the model's `cold_start_timeout`. The wait itself is
the queue's: the request is sent as soon as the new replica is in the endpoint list (the pub/sub hint
wakes the gateway). Meanwhile the control plane is told at once (gateway.observe.demand), so a
replica is placed now, not at the next timer tick.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.routing.admission import Shed


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
