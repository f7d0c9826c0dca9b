"""Which running answer a waiting request takes the slot of, pure: `evict(waiting, running, settings)`.

Admission can only order a queue: on a full replica the request that ranks first still waits for the
next answer to end. llmgw resumes an answer on another replica word for word (gateway.http.resume),
so it can take a slot back without losing anything: the answer it displaces is paused, waits at the
head of its key's queue, and goes on where it stopped when a slot frees. This module decides when.

A waiting request outranks a running answer when
- its criticality class is higher (critical > standard > sheddable > a batch line), or
- it is interactive and the answer is a batch line, or
- in the same class, its key's fair-share counter (gateway.routing.fairness) is behind the running
  answer's key's by more than `margin` of its own requests.

Only an answer that resumes exactly may be evicted (`Running.fixed` says why another cannot), one
that has run at least `min_run` seconds (a heavy tenant still makes progress), and one evicted fewer
than `max_evictions` times. Of those, the victim is the one whose loss costs least: the fewest tokens
generated (what the new replica computes again, less what its prefix cache holds), then the key most
over its share (the highest counter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from llmgw.state.keypolicy import PRIORITY_RANK

BATCH = "batch"  # a batch line's class: below every interactive one


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    margin: float = 0.5  # in requests of the waiting key: how far behind its counter must be
    min_run: float = 0.25  # seconds an answer runs on its replica before it may be evicted
    max_evictions: int = 2  # times one answer may be evicted


@dataclass(frozen=True)
class Running:
    """An answer being generated on an endpoint, as eviction sees it."""

    ident: int  # its worker's handle on it
    endpoint: str
    klass: str  # its criticality (`critical`, `standard`, `sheddable`) or BATCH
    key: str  # its tenant's key ("" without one)
    counter: float  # its key's fair-share counter on the model
    tokens: int  # tokens generated so far
    running_for: float  # seconds since it started on this endpoint
    evictions: int = 0  # times it was evicted already
    fixed: str | None = None  # why it cannot be evicted (None: it resumes exactly)


@dataclass(frozen=True)
class Waiting:
    """The request that ranks first in its model's queue, as eviction sees it."""

    klass: str
    key: str
    counter: float  # its key's counter on the model
    turn: float  # what one of its requests costs, in counter units (its key's tokens over weight)
    endpoints: frozenset[str] | None = None  # where it may be sent (None: anywhere its model is served)


@dataclass(frozen=True)
class Evict:
    victim: Running
    reason: str  # why the waiting request outranks it, in words


@dataclass(frozen=True)
class Keep:
    """No answer is evicted; `reason` says why (for `llmgw explain` and the metrics). `retry_in`: seconds
    until an answer it outranks has run its minimum (when that is all that keeps it), else None."""

    reason: str
    retry_in: float | None = None


def outranks(w: Waiting, r: Running, s: Settings) -> str | None:
    """Why `w` outranks `r`, or None."""
    wr, rr = PRIORITY_RANK.get(w.klass, 1), PRIORITY_RANK.get(r.klass, 1)
    if wr > rr:
        return "an interactive request over a batch line" if r.klass == BATCH else f"{w.klass} over {r.klass}"
    if wr < rr or w.key == r.key:
        return None
    if r.counter - w.counter > s.margin * w.turn:
        return (f"its key's fair-share counter is {r.counter - w.counter:.0f} behind the running key's "
                f"(margin {s.margin:g} of its requests: {s.margin * w.turn:.0f})")
    return None


def evictable(r: Running, s: Settings) -> str | None:
    """Why `r` may not be evicted now, or None."""
    if r.fixed is not None:
        return r.fixed
    if r.evictions >= s.max_evictions:
        return f"it was evicted {r.evictions} times already (LLMGW_GATEWAY_EVICT_MAX)"
    if r.running_for < s.min_run:
        return f"it has run {r.running_for:.2f}s, under the {s.min_run:g}s minimum (LLMGW_GATEWAY_EVICT_MIN_RUN)"
    return None


def evict(w: Waiting, running: Iterable[Running], s: Settings) -> Evict | Keep:
    """The answer `w` takes the slot of, or why none."""
    if not s.enabled:
        return Keep("eviction is off (LLMGW_GATEWAY_EVICT=0)")
    best: Running | None = None
    best_reason = ""
    why_not = "no answer runs where it may be sent"
    soonest: float | None = None  # until an outranked answer has run its minimum
    for r in running:
        if w.endpoints is not None and r.endpoint not in w.endpoints:
            continue
        reason = outranks(w, r, s)
        if reason is None:
            why_not = "it outranks no running answer"
            continue
        fixed = evictable(r, s)
        if fixed is not None:
            why_not = f"the answers it outranks may not be evicted: {fixed}"
            if r.fixed is None and r.evictions < s.max_evictions:  # only too young: it will be evictable
                wait = s.min_run - r.running_for
                soonest = wait if soonest is None else min(soonest, wait)
            continue
        if best is None or (r.tokens, -r.counter, r.ident) < (best.tokens, -best.counter, best.ident):
            best, best_reason = r, reason
    return Evict(best, best_reason) if best is not None else Keep(why_not, soonest)
