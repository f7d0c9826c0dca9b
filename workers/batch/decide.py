"""The batch feeder's decisions, pure: how many lines it may have in flight (`allowance`, over what
the fleet holds), what an answer means for its line (`judge`), and what a run does next (`step`).

**Room.** Batch lines go through the gateway in the `batch` class (the lowest: shed like `sheddable`),
which admission sheds (429) as soon as a model is saturated or standard requests wait. That alone would let them fill every slot up
to saturation, and an interactive request arriving then waits for one to free. So the feeder also
keeps each endpoint below `(1 - reserve) x capacity` (at least one line): it reads what every endpoint holds, as the
gateways reported it (every half second: their requests in flight there, the batch's own lines
among them), or, with no gateway report, the engine's last scrape (running + waiting), and sends
only into the room left, shared between the feeders of the model. Its own lines it tells apart in
the gateways' counts by identity, not by time: each line says which feeder sent it (`X-LLMGW-Feeder`)
and each report says how many of each feeder's lines it holds (`GatewayReport.feeders`), counted
with the endpoints' counts at the same instant. So it may have in flight what the reports counted of
its lines plus its share of the room they left, whatever the lines took to reach the gateways: a line
not counted yet is neither held nor its own, and the room it takes is not free twice. A scrape
cannot tell its lines from others', and counts them all as others' (it sends less, never more). An
engine that queues (waiting > 0) has no room, and nor has the model while a gateway queues a standard
request for it. An endpoint without a declared `capacity` is sized by the most sequences its engine
was seen running, and probed one line more per view while its engine queues nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from llmgw.state.batch_records import BatchRecord
from llmgw.state.demand_records import GatewayReport
from llmgw.state.records import EndpointInfo, LoadRecord

STALE_LOAD = 3.0  # seconds after which a scrape says nothing (the gateway's LLMGW_GATEWAY_STALE_AFTER)
MAX_BACKOFF = 30.0


@dataclass(frozen=True)
class Room:
    """What the model's endpoints can take beyond what they held at `at` (wall clock of the reports
    or scrapes it was read from): `free` lines in all (negative: they held more than the batch tier may
    fill), over `endpoints` endpoints; `queued`: standard requests the gateways held for the model;
    `mine`: the lines of the feeder that asked the reports counted among what they held."""

    free: int
    endpoints: int
    queued: int = 0
    at: float = 0.0
    mine: int = 0


def room(model: str, endpoints: Sequence[EndpointInfo], loads: Mapping[str, LoadRecord],
         reports: Sequence[GatewayReport], now: float, reserve: float, slots_seen: Mapping[str, int],
         feeder: str = "") -> Room:
    """The room the batch tier has on `model`'s endpoints (see the module's docstring), and what the
    reports held of `feeder`'s lines."""
    mine = [e for e in endpoints if model in e.models]
    reported: dict[str, int] = {}
    queued = 0
    counted = 0
    for r in reports:
        if feeder:
            counted += r.feeders.get(feeder, 0)
        for eid, use in r.endpoints.items():
            reported[eid] = reported.get(eid, 0) + use.inflight
        for name, demand in r.models.items():
            if name == model or any(name == e.model for e in mine):
                queued += demand.queued
    free = 0
    stamps = [r.at for r in reports]
    for e in mine:
        load = loads.get(e.id)
        fresh = load is not None and load.ok and now - load.ts <= STALE_LOAD
        waiting = int(load.waiting or 0) if fresh and load is not None else 0
        if reports:
            held = reported.get(e.id, 0)
        elif fresh and load is not None:
            held = int((load.running or 0) + waiting)
            stamps.append(load.ts)
        else:
            held = 0
        slots = e.capacity or slots_seen.get(e.id)
        if slots:
            # At least one line on an endpoint that holds nothing else (a capacity of 1 or 2 and a
            # reserve would otherwise never run a batch).
            left = max(1, math.floor(slots * (1.0 - reserve))) - held
            free += min(left, -waiting) if waiting else left
        elif fresh:
            # No capacity known: one more while the engine queues nothing, fewer when it does.
            free += -waiting if waiting else 1
    if queued:
        free = min(free, -queued)
    return Room(free, len(mine), queued, min(stamps) if stamps else now, counted)


def learn_slots(slots_seen: Mapping[str, int], loads: Mapping[str, LoadRecord]) -> dict[str, int]:
    """The most sequences each engine was seen running at once (a batch limit it has for sure)."""
    out = dict(slots_seen)
    for eid, load in loads.items():
        if load.ok and load.running:
            out[eid] = max(out.get(eid, 0), int(load.running))
    return out


def allowance(r: Room, mine: int, feeders: int, most: int) -> int:
    """How many lines this feeder may have in flight: what the room's reports counted of its lines
    (`mine`), plus its share of the room (a negative room shrinks every feeder of the model alike),
    never below 0 nor above `most`."""
    share = r.free / max(1, feeders)
    return max(0, min(most, mine + math.floor(share)))


@dataclass
class Throttle:
    """How many lines a feeder may have in flight, between views: `allowance` at each view, from what
    the reports counted of its lines (never more than it has in flight now: one it no longer waits for
    is another's as far as it knows); a shed line (429) stops its growth until the next view."""

    most: int
    allow: int = 0

    def view(self, r: Room, feeders: int, inflight: int) -> int:
        self.allow = allowance(r, min(r.mine, inflight), feeders, self.most)
        return self.allow

    def shed(self, inflight: int) -> None:
        self.allow = min(self.allow, inflight)

    def may_send(self, inflight: int) -> bool:
        return inflight < self.allow


# --- one line's answer --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Keep:
    """The answer is the line's result: to the output file (`ok`) or the error file."""

    ok: bool


@dataclass(frozen=True)
class Again:
    """Send the line again after `after` seconds. `counted`: the try counts against the retries
    (server errors, no answer); a shed line, or one waiting for a replica, waits its turn uncounted."""

    after: float
    counted: bool
    reason: str


@dataclass(frozen=True)
class GiveUp:
    """No answer worth keeping after every retry: the line goes to the error file with this code."""

    code: str
    message: str


def judge(status: int, retry_after: float | None, tries: int, retries: int, error: str = "",
          unreached: bool = False) -> Keep | Again | GiveUp:
    """What one answer (`status` 0: none came: `error` says why) means for its line, on try `tries`
    (counted tries so far, this one included) of `1 + retries`. `unreached`: no gateway took the
    connection (one restarting): the line waits, its tries not used up."""
    if unreached:
        return Again(min(MAX_BACKOFF, 2.0 ** min(tries, 4)), False, "unreached")
    if 200 <= status < 300:
        return Keep(True)
    if status == 429:
        return Again(max(1.0, retry_after or 1.0), False, "shed")
    if status == 401:
        # The gateway has not read the batch workers' key yet (it reads the key table every 2 s).
        return Again(1.0, True, "unauthorized") if tries <= max(retries, 10) else Keep(False)
    if status == 503:
        # No Ready replica now (starting, scaled to zero, restarting): wait like a shed line.
        return Again(min(MAX_BACKOFF, max(1.0, retry_after or 2.0 ** min(tries, 5))), False, "unavailable")
    if status in (0, 500, 502, 504):
        if tries <= retries:
            return Again(min(MAX_BACKOFF, 2.0 ** (tries - 1)), True, f"HTTP {status}" if status else error)
        if status == 0:
            return GiveUp("no_answer", f"no answer after {tries} tries: {error}")
        return Keep(False)
    return Keep(False)


# --- what a run does next --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Feed:
    pass


@dataclass(frozen=True)
class Drain:
    """Send nothing more; wait for the lines in flight (cancelled or expired)."""

    why: str


@dataclass(frozen=True)
class Seal:
    """No more lines: `why` is completed, cancelled or expired (unanswered lines get an error line
    first when it expired)."""

    why: str


@dataclass(frozen=True)
class Finish:
    """Sealed before (a run died after sealing): make its files and the final status."""


@dataclass(frozen=True)
class Nothing:
    pass


def step(b: BatchRecord, now: float, inflight: int, drain_seconds: float) -> Feed | Drain | Seal | Finish | Nothing:
    if b.ended:
        return Nothing()
    if b.sealed_at is not None:
        return Finish()
    ending = None
    since = 0.0
    if b.cancelling_at is not None:
        ending, since = "cancelled", b.cancelling_at
    elif now >= b.expires_at:
        ending, since = "expired", b.expires_at
    if ending is not None:
        if inflight == 0 or now - since >= drain_seconds:
            return Seal(ending)
        return Drain(ending)
    if b.done >= b.total:
        return Seal("completed")
    return Feed()
