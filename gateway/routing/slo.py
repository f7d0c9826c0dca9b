"""Admission for a request with latency targets, pure, beside gateway.routing.admission's `decide` and
`after_wait`: what a request's targets change in what they said (`admit`, `after_wait`), the targets
as routing reads them (`slo_of`), and when a waiting request's first byte is due (`due`, the queue's
order: gateway.routing.ledger.Backlog).

- A strict request no open endpoint is predicted to serve within its targets (routing's MISSES) is
  refused at once: 429 with the predicted time and `Retry-After`.
- A strict request that finds its model saturated is refused at once when the wait for its turn (its
  place in the queue over the model's completion rate) plus the first byte it would get once a slot
  frees is over its target; else it waits at most until its target can no longer be met, and is then
  refused, rather than served late.
- Any other request with targets is admitted as before: routing sent it where its miss is smallest,
  and in the queue it goes first when its slack runs short (`due`).

The proxy (gateway.http.admit) and the simulators (bench/simshell.py) call these after `decide` and
`after_wait`; a request without targets never reaches them.
"""

from __future__ import annotations

import math
from dataclasses import replace

from gateway.routing.admission import SATURATED, Queue, Refuse, Send, Shed, TimedOut, drain_time
from gateway.routing.choice import MISSES, Choice, Rejection, Slo
from llmgw.slo import Targets, format_duration

SLO_MISS = "slo_miss"  # the shed label of a request refused as predicted to miss its targets


def slo_of(t: Targets, elapsed: float, stream: bool) -> Slo | None:
    """Targets `t` as routing reads them, `elapsed` seconds after the request arrived (None: none)."""
    if not t:
        return None
    return Slo(None if t.ttft is None else t.ttft - elapsed, t.tpot,
               None if t.deadline is None else t.deadline - elapsed, t.strict, stream)


def budget(slo: Slo) -> float | None:
    """Seconds left for the first byte the client sees (a whole answer's, when it does not stream): its
    TTFT target, else its deadline (which bounds its first byte too)."""
    if slo.stream:
        return slo.ttft if slo.ttft is not None else slo.total
    left = [b for b in (slo.ttft, slo.total) if b is not None]
    return min(left) if left else None


def _first(result: Choice | Rejection, stream: bool) -> float | None:
    """The first byte a routing result predicts, from a slot (a saturated model's: once one frees)."""
    if isinstance(result, Choice):
        return result.predicted_ttft if stream else result.predicted_total
    return result.predicted


def _secs(s: float) -> str:
    return format_duration(max(0.001, round(s, 3)))


def admit(step: Send | Queue | Refuse, result: Choice | Rejection, slo: Slo, position: int,
          rate: float | None) -> Send | Queue | Refuse:
    """What `decide`'s `step` becomes for a request with targets `slo`: `position` is its place in the
    queue (1: next), `rate` the requests per second the model's endpoints complete when full (None:
    not known, so its wait is not counted)."""
    if isinstance(result, Rejection) and result.kind == MISSES:
        late = (result.predicted or 0.0) - (budget(slo) or 0.0)
        return Refuse(Shed(f"{result.detail} (X-LLMGW-SLO: strict)", max(1, math.ceil(late))), SLO_MISS)
    if not slo.strict or not isinstance(step, Queue) or step.why != SATURATED:
        return step
    left = budget(slo)
    if left is None:
        return step
    first = _first(result, slo.stream) or 0.0
    wait = drain_time(position, rate) or 0.0
    if wait + first > left:
        return Refuse(Shed(f"no endpoint is predicted to meet its targets: its first byte in about "
                           f"{_secs(wait + first)} (a wait of {_secs(wait)} for its turn in the queue, then "
                           f"{_secs(first)}), over the {_secs(left)} left of its target (X-LLMGW-SLO: strict)",
                           max(1, math.ceil(wait + first - left))), SLO_MISS, give_back=step.give_back)
    return replace(step, timeout=min(step.timeout, max(0.0, left - first)))


def after_wait(step: Send | Refuse, slo: Slo, queued: Queue, queue_timeout: float) -> Send | Refuse:
    """What `after_wait`'s `step` becomes for a request with targets: a strict one whose wait ran out
    before the queue's own bound (`queue_timeout`) is refused as its target can no longer be met; one
    that routing refused as predicted to miss is refused as such."""
    if not isinstance(step, Refuse):
        return step
    err = step.error
    if isinstance(err, Rejection) and err.kind == MISSES:
        return Refuse(Shed(f"{err.detail} (X-LLMGW-SLO: strict)", 1), SLO_MISS)
    if slo.strict and isinstance(err, TimedOut) and queued.why == SATURATED and err.seconds < queue_timeout:
        return Refuse(Shed(f"its first byte can no longer come within its target: it waited "
                           f"{_secs(err.seconds)} for a slot (X-LLMGW-SLO: strict)", 1), SLO_MISS)
    return step


def due(arrived: float, t: Targets) -> float:
    """When a waiting request's first byte is due, on the clock of `arrived` (its target TTFT, else its
    deadline; inf: no target): the least due goes first once its slack runs short (Backlog.head)."""
    if t.ttft is not None:
        return arrived + t.ttft
    if t.deadline is not None:
        return arrived + t.deadline
    return math.inf
