"""What this gateway tells others and learns from them, off the request path: what it sent and what it
holds, for the other gateways (gateway.server.sendshare carries both through Redis; docs/gateway.md),
what they said of theirs, and the facts of its own report (gateway.server.background).

An object over the in-flight counts (gateway.routing.inflight), taking their lock for each step: the
request path changes the counts (gateway.routing.router) and never calls this.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

from gateway.routing.inflight import InFlight
from gateway.routing.othergateways import report_due
from gateway.routing.prefill import PrefixTally
from gateway.routing.tables import Tables
from llmgw.state.clock import Clock
from llmgw.state.demand_records import GatewaySent


class ReportFacts(NamedTuple):
    """What the gateway report says of this process's requests, copied at one instant."""

    version: int  # the endpoint list routed by
    inflight: dict[str, int]  # per endpoint
    ok_at: dict[str, float]  # per endpoint, the last response head (wall clock)
    fail_at: dict[str, float]  # per endpoint, the last connection failure or first-byte timeout
    by_model: dict[str, int]  # requests in flight per canonical model name
    last_request_at: dict[str, float]  # per canonical model name


class Exchange:
    """`counts`: the process's in-flight counts (their outbox set when its sends are shared);
    `tables`: the endpoint list routed by now (the router's). `says_holds`: whether this gateway tells
    the others what it holds; the benchmark baselines (`LLMGW_GATEWAY_POLICY`) say nothing, as they
    stand for peers whose instances share nothing."""

    def __init__(self, counts: InFlight, tables: Callable[[], Tables], clock: Clock, says_holds: bool = True):
        self.counts, self.tables, self.clock, self.says_holds = counts, tables, clock, says_holds
        # What this gateway last told the others it holds, and when (`take_holds`; under the counts' lock).
        self._holds_said: dict[str, int] | None = None
        self._holds_said_at = float("-inf")

    @property
    def shares_sends(self) -> bool:
        """Whether what this process sends is kept for the other gateways (`take_sends`)."""
        return self.counts.outbox is not None

    def take_sends(self) -> list[GatewaySent]:
        """What this process sent since the last call, oldest first."""
        counts = self.counts
        with counts.lock:
            if not counts.outbox:
                return []
            out = list(counts.outbox)
            counts.outbox.clear()
            return out

    def learn_sends(self, sends: list[GatewaySent]) -> None:
        """What the other gateways sent (gateway.server.sendshare read it from Redis), into our prefix
        index and prefill backlog, as a sibling worker's sends are: so the next turn of a conversation
        that another gateway served finds its history here too. Their wall clock times become ours
        by their age; a send long past has drained and adds no backlog."""
        if not sends:
            return
        listed = self.tables().by_id
        now, wall = self.clock.monotonic(), self.clock.time()
        counts = self.counts
        with counts.lock:
            for s in sends:
                if s.endpoint in listed:
                    counts.prefixes.sent(s.endpoint, s.keys)
                    counts.backlog.add(s.endpoint, s.prefill, now - max(0.0, wall - s.at))

    def take_holds(self) -> dict[str, int] | None:
        """What this gateway holds per endpoint (its workers together), for the other gateways, when
        it is time to say it (gateway.routing.othergateways.report_due); None otherwise."""
        if not self.says_holds:
            return None
        now = self.clock.monotonic()
        with self.counts.lock:
            counts = self.counts.gateway_held(self.tables().by_id, now)
            if not report_due(counts, self._holds_said, self._holds_said_at, now):
                return None
            self._holds_said, self._holds_said_at = counts, now
            return counts

    def learn_holds(self, origin: str, counts: Mapping[str, int], at: float) -> None:
        """Another gateway (`origin`) held `counts` at `at` (its wall clock): counted from now on as
        its sibling workers' are (gateway.routing.othergateways), until it says otherwise or goes silent."""
        now = self.clock.monotonic()
        listed = self.tables().by_id
        mine = {e: int(n) for e, n in counts.items() if e in listed and n > 0}
        with self.counts.lock:
            self.counts.remote.learn(origin, mine, now - max(0.0, self.clock.time() - at), now)

    def remote_held(self) -> dict[str, int]:
        """Per listed endpoint, what the other gateways said they hold there now (0: nothing)."""
        ids = list(self.tables().by_id)
        with self.counts.lock:
            held = self.counts.remote.others(ids, self.clock.monotonic())
        return {i: held.get(i, 0) for i in ids}

    def report_facts(self) -> ReportFacts:
        """A consistent copy for the gateway report: the list's version, then `InFlight.facts`."""
        with self.counts.lock:
            return ReportFacts(self.tables().version, *self.counts.facts())

    def prefix_facts(self) -> dict[str, PrefixTally]:
        """Per endpoint, what was seen of its prefix cache (the report's hit ratios)."""
        with self.counts.lock:
            return dict(self.counts.tally)
