"""Who gets in when a model is saturated: a pure `admit(...)`; the queue itself is gateway.routing.queue.

A model is saturated when every one of its endpoints is (waiting >= max_waiting, KV >= max_kv, or
what it holds >= capacity), or when the router judged that waiting for a full but much faster
endpoint beats the open ones. Then:
- `critical` is always sent (the router picks the endpoint with the lowest expected completion);
- `sheddable` gets 429 at once, and also whenever standard requests are already waiting;
- `standard` waits in a bounded FIFO queue and is sent as soon as an endpoint frees. It is refused
  (429 with Retry-After) only when the queue cannot drain in time: at once when the estimated wait,
  its queue position over the fleet's learned completion rate, exceeds the wait bound, or when the
  queue is full, or when its wait actually reaches the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.routing.choice import Choice, Rejection


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


def drain_time(position: int, rate: float | None) -> float | None:
    """Seconds until the request at queue `position` (1 = head) gets an endpoint, when every endpoint
    is full and they complete `rate` requests per second between them; None when the rate is unknown."""
    if not rate or rate <= 0:
        return None
    return position / rate


def admit(result: Choice | Rejection, priority: str, queue_len: int, queue_max: int, queue_timeout: float,
          drain: float | None = None):
    """Decide for one routing result. `queue_len` is how many wait ahead; `drain` is `drain_time` for
    this request's place in the queue. Unknown-model / no-Ready rejections are not admission's
    business and are returned unchanged for the caller's error table."""
    if isinstance(result, Rejection) and result.kind != "saturated":
        return result
    if priority == "critical":
        # choose() never rejects critical traffic for saturation.
        return Send(result) if isinstance(result, Choice) else Shed("saturated", 1)
    if priority == "sheddable" and (isinstance(result, Rejection) or queue_len > 0):
        return Shed("model saturated; sheddable requests are rejected first", 1)
    if isinstance(result, Choice):
        # The router saw the queue (RouteRequest.queued): a Choice means an open endpoint serves this
        # request sooner than waiting behind the queued ones for a faster endpoint would.
        return Send(result)
    if queue_len >= queue_max or queue_timeout <= 0:
        return Shed("model saturated and its queue is full", max(1, math.ceil(queue_timeout)))
    if drain is not None and drain > queue_timeout:
        return Shed(f"model saturated; its queue would take about {drain:.0f}s to reach this request, "
                    f"over the {queue_timeout:g}s wait bound", max(1, math.ceil(drain - queue_timeout)))
    return Wait()
