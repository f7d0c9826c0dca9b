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


def slack(slo: Slo, waited: float, result: Choice | Rejection, rate: float | None) -> float | None:
    """Seconds a waiting request's first-byte target leaves it past the first byte it would get once the
    next slot frees (the model completes `rate` requests a second when full; None: not known), having
    waited `waited`; under 0 it will miss it unless it takes a slot now (eviction's `Waiting.slack`).
    None: no target bounds its first byte."""
    left = budget(slo)
    if left is None:
        return None
    return left - waited - (_first(result, slo.stream) or 0.0) - (1.0 / rate if rate else 0.0)


def running_slack(t: Targets, elapsed: float, running_for: float, began: bool) -> float | None:
    """Seconds a running answer has to spare on its own targets if it is paused now (eviction's
    `Running.slack`), `elapsed` after its request arrived, having run `running_for` on its replica;
    `began`: its first byte went out. A time per token it would break: none to spare; a deadline: what
    is left of it past as long again as it has run; a first byte still to come: what is left of its
    target. None: nothing it has left to meet (so a pause costs it no target)."""
    if t.tpot is not None:
        return 0.0
    if t.deadline is not None:
        return t.deadline - elapsed - running_for
    if t.ttft is not None and not began:
        return t.ttft - elapsed
    return None


def due(arrived: float, t: Targets) -> float:
    """When a waiting request's first byte is due, on the clock of `arrived` (its target TTFT, else its
    deadline; inf: no target): the least due goes first once its slack runs short (Backlog.head)."""
    if t.ttft is not None:
        return arrived + t.ttft
    if t.deadline is not None:
        return arrived + t.deadline
    return math.inf
