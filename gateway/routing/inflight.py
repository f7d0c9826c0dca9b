"""What the request path changes: the in-flight counts and their change logs, where this process sent
which prompts (its prefix index, prefill backlog and outbox), the answers to learn from, and the
evidence of each endpoint. The only state a request mutates, under the one lock this object owns.

Counts change under `lock` (the router chooses and reserves a slot at once, gateway.routing.router;
the exchange with the other gateways reads and feeds them, gateway.routing.exchange); the
timestamps are single dict stores (atomic between greenlets and threads). A count is shared with the
sibling gunicorn workers as it changes (gateway.server.siblings), so routing counts what the whole
gateway holds. The change log lets a LoadRecord be compared with what we held when it was scraped
(its `ts`).
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import nullcontext
from typing import Iterable, Mapping, NamedTuple

from gateway.routing.backlog import PrefillBacklog
from gateway.routing.othergateways import RemoteHolds
from gateway.routing.prefill import NO_TALLY, PrefixTally
from gateway.routing.prefixindex import PrefixIndex
from llmgw.state.demand_records import GatewaySent
from llmgw.state.records import EndpointInfo

CHANGES_KEPT = 512  # changes of our in-flight count kept per endpoint (seconds of traffic)
STALE_SCRAPE = 10.0  # a LoadRecord scraped longer ago than this (by its ts) is not matched to our count
CLOCK_SLACK = 1.0  # tolerated lead of the agent's clock over ours (NTP keeps them within milliseconds)
# Sends kept for the other gateways while Redis does not take them (the oldest are dropped first:
# what they would have told the others is stale by then).
OUTBOX_MAX = 10_000


class Answer(NamedTuple):
    """One finished request to learn from (gateway.routing.learn), taken as it ended."""

    endpoint: str
    at: float  # when it ended (the router's monotonic clock)
    concurrency: float  # the batch it ran in
    decode: float  # seconds after its first byte
    tokens: int | None  # completion tokens, when the answer reported usage
    ttfb: float | None  # its time to first byte, when it found a free slot (else None)


_ALONE = nullcontext()


def model_of(ep: EndpointInfo) -> str:
    return ep.model or ep.models[0]


class InFlight:
    """This process's requests per endpoint and per model, with their change logs and evidence, and
    where it sent which prompt. `shared`: the sibling workers' table (gateway.server.siblings.SharedCounts;
    None: counted alone). `outbox`: keep what is sent with prompt keys for the other gateways
    (gateway.server.sendshare drains it through gateway.routing.exchange)."""

    def __init__(self, shared=None, outbox: bool = False):
        self.lock = threading.Lock()  # everything below but the evidence's timestamps
        self.shared = shared
        self.counts: dict[str, int] = {}  # ours; kept for endpoints that left the list while in flight
        self.by_model: dict[str, int] = {}  # by canonical model name
        # Per endpoint, the last changes of our count: (wall clock, count before, after).
        self.changes: dict[str, deque[tuple[float, int, int]]] = {}
        self.answers: list[Answer] = []  # since the learner last took them
        self.ok_at: dict[str, float] = {}  # wall clock of the last response head per endpoint
        self.fail_at: dict[str, float] = {}  # ... of the last connection failure or first-byte timeout
        self.last_request_at: dict[str, float] = {}  # by canonical name (the requested one if unpublished)
        # The other gateways' counts, as they last said (gateway.routing.othergateways): counted as siblings'.
        self.remote = RemoteHolds()
        self.prefixes = PrefixIndex()  # the block keys sent to each endpoint
        self.backlog = PrefillBacklog()  # the prefill sent to each endpoint lately
        # Per endpoint, what was seen of its prefix cache (gateway.routing.prefill.PrefixTally).
        self.tally: dict[str, PrefixTally] = {}
        # What this process sent with prompt keys, oldest first, for the other gateways (None: not shared).
        self.outbox: deque[GatewaySent] | None = deque(maxlen=OUTBOX_MAX) if outbox else None

    def sent(self, c, keys, tallied: bool, decision, wall: float, now: float) -> None:
        """A request with prompt `keys` was reserved a slot by `c` (a gateway.routing.choice.Choice):
        into the prefix index, the sibling workers' log, the outbox and (`tallied`) the endpoint's
        prefix tally. Under `lock`, in `decision` (`deciding()`)."""
        eid = c.endpoint.id
        self.prefixes.sent(eid, keys)
        if self.shared is not None and getattr(decision, "held", False):
            self.shared.sent.append(eid, keys, now, c.prefill)
        if self.outbox is not None:
            self.outbox.append(GatewaySent(eid, keys, wall, c.prefill))
        if tallied:
            t = self.tally.get(eid, NO_TALLY)
            self.tally[eid] = PrefixTally(t.routed + c.prompt, t.expected + c.matched, t.answered, t.reused)

    def reused(self, endpoint_id: str, prompt: int, cached: int) -> None:
        """An answer said how much of its prompt the engine reused (llama.cpp's timings.cache_n)."""
        with self.lock:
            t = self.tally.get(endpoint_id, NO_TALLY)
            self.tally[endpoint_id] = PrefixTally(t.routed, t.expected, t.answered + prompt, t.reused + cached)

    def add(self, ep: EndpointInfo, wall: float, now: float, adapter: str = "") -> None:
        n = self.counts[ep.id] = self.counts.get(ep.id, 0) + 1
        self._changed(ep.id, n - 1, n, wall, now)
        m = model_of(ep)
        self.by_model[m] = self.by_model.get(m, 0) + 1
        if adapter:  # a LoRA adapter's requests count under its name too (its demand, for placement)
            self.by_model[adapter] = self.by_model.get(adapter, 0) + 1

    def remove(self, ep: EndpointInfo, wall: float, now: float, adapter: str = "") -> int:
        """One request left `ep`; returns what we held on it before."""
        m = model_of(ep)
        self.by_model[m] = max(0, self.by_model.get(m, 0) - 1)
        if adapter:
            self.by_model[adapter] = max(0, self.by_model.get(adapter, 0) - 1)
        ours = self.counts.get(ep.id, 0)
        self.counts[ep.id] = max(0, ours - 1)
        self._changed(ep.id, ours, self.counts[ep.id], wall, now)
        return ours

    def _changed(self, eid: str, before: int, after: int, wall: float, now: float) -> None:
        q = self.changes.get(eid)
        if q is None:
            q = self.changes[eid] = deque(maxlen=CHANGES_KEPT)
        q.append((wall, before, after))
        if self.shared is not None:
            self.shared.publish(eid, before, after, now)

    def siblings(self, eid: str, now: float) -> int:
        """What the sibling workers and the other gateways hold on `eid` now."""
        n = self.shared.others((eid,), now).get(eid, 0) if self.shared is not None else 0
        return n + self.remote.others((eid,), now).get(eid, 0) if self.remote else n

    def others_recent(self, endpoint_ids, now: float) -> dict[str, int]:
        """The most the sibling workers and the other gateways held on each endpoint lately: what a
        scrape taken then may show of theirs."""
        out = self.shared.others(endpoint_ids, now, recent=True) if self.shared is not None else {}
        if self.remote:
            for eid, n in self.remote.others(endpoint_ids, now, recent=True).items():
                out[eid] = out.get(eid, 0) + n
        return out

    def gateway_held(self, endpoint_ids, now: float) -> dict[str, int]:
        """What this gateway holds on each endpoint, its workers together (what it tells the other
        gateways: gateway.routing.othergateways), without what they told it."""
        out = {eid: n for eid in endpoint_ids if (n := self.counts.get(eid, 0)) > 0}
        if self.shared is not None:
            for eid, n in self.shared.others(endpoint_ids, now).items():
                out[eid] = out.get(eid, 0) + n
        return out

    def deciding(self):
        """The siblings' lock around one routing decision (gateway.server.siblings), or none alone."""
        return self.shared.deciding() if self.shared is not None else _ALONE

    def learn_siblings_sent(self, decision, endpoints) -> None:
        """What the sibling workers sent each of `endpoints` since our last look (gateway.server.sentlog),
        into the prefix index: the whole gateway's traffic, so a conversation's next turn finds its
        history whichever worker takes it. And into the prefill backlog, from when each was sent (the
        workers share the host's monotonic clock): a send long past has drained and adds nothing.
        Under `lock`, while `decision` (our `deciding()`) holds the siblings' lock; nothing otherwise."""
        if self.shared is None or not getattr(decision, "held", False):
            return
        for sent in self.shared.sent.siblings_sent(endpoints):
            self.prefixes.sent(sent.endpoint, sent.keys)
            self.backlog.add(sent.endpoint, sent.prefill, sent.at)

    def held(self, endpoints: Iterable[EndpointInfo], now: float, model: str | None = None) -> Mapping[str, int]:
        """What is held per endpoint (of `model`, or all) as this gateway knows it at once: our own
        requests, the sibling workers' and what the other gateways said they hold."""
        if self.shared is None and not self.remote:
            return self.counts
        both = dict(self.counts)
        ids = [e.id for e in endpoints if model is None or model in e.models]
        if self.shared is not None:
            for eid, n in self.shared.others(ids, now).items():
                both[eid] = both.get(eid, 0) + n
        if self.remote:
            for eid, n in self.remote.others(ids, now).items():
                both[eid] = both.get(eid, 0) + n
        return both

    def held_at(self, eid: str, ts: float, wall: float) -> int:
        """What we held on the endpoint at wall-clock time `ts`. When the agent's clock does not
        agree with ours, or the changes kept do not reach back that far, the most we held in what
        is kept (so our own ended requests are never taken for another gateway's)."""
        now = self.counts.get(eid, 0)
        q = self.changes.get(eid)
        if not q:
            return now
        if wall - STALE_SCRAPE <= ts <= wall + CLOCK_SLACK:
            for t, before, after in reversed(q):
                if t <= ts:
                    return after
            if len(q) < CHANGES_KEPT:
                return q[0][1]  # every change since we started is kept: before the first one
        return max(now, max(after for _, _, after in q))

    def take_answers(self) -> list[Answer]:
        answers, self.answers = self.answers, []
        return answers

    def prune(self, listed: Mapping[str, EndpointInfo]) -> None:
        """A new endpoint list: forget the endpoints that left it, unless requests are in flight on
        them (the report must show those: the control plane waits for them before stopping). Under `lock`."""
        self.counts = {k: n for k, n in self.counts.items() if n > 0 or k in listed}
        self.ok_at = {k: t for k, t in self.ok_at.items() if k in self.counts}
        self.fail_at = {k: t for k, t in self.fail_at.items() if k in self.counts}
        self.changes = {k: v for k, v in self.changes.items() if k in self.counts}
        self.answers = [a for a in self.answers if a.endpoint in listed]
        self.prefixes.listed({i: ep.kv_tokens for i, ep in listed.items()})
        self.backlog.keep(listed)
        for i in [i for i in self.tally if i not in listed]:
            del self.tally[i]

    def facts(self) -> tuple[dict, dict, dict, dict, dict]:
        """Copies for the gateway report: counts, ok_at, fail_at, per model, last request per model."""
        return (dict(self.counts), dict(self.ok_at), dict(self.fail_at), dict(self.by_model),
                dict(self.last_request_at))
