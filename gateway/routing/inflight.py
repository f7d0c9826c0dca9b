"""What the request path changes: the in-flight counts and their change logs, the answers to learn
from, and the evidence of each endpoint. The only state a request mutates.

Counts change under the router's lock (a slot is chosen and reserved at once); the timestamps are
single dict stores (atomic between greenlets and threads). A count is shared with the sibling
gunicorn workers as it changes (gateway.server.siblings), so routing counts what the whole gateway
holds. The change log lets a LoadRecord be compared with what we held when it was scraped (its `ts`).
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Iterable, Mapping, NamedTuple

from gateway.routing.othergateways import RemoteHolds
from llmgw.state.records import EndpointInfo

CHANGES_KEPT = 512  # changes of our in-flight count kept per endpoint (seconds of traffic)
STALE_SCRAPE = 10.0  # a LoadRecord scraped longer ago than this (by its ts) is not matched to our count
CLOCK_SLACK = 1.0  # tolerated lead of the agent's clock over ours (NTP keeps them within milliseconds)


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
    """This process's requests per endpoint and per model, with their change logs and evidence."""

    def __init__(self, shared=None):
        # The sibling workers' table (gateway.server.siblings.SharedCounts; None: counted alone).
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

    def siblings_sent(self, decision, endpoints) -> list:
        """What the sibling workers sent each of `endpoints` since our last look (gateway.server.sentlog
        `Sent`: endpoint id, prompt keys, when, prefill seconds), read while `decision` (our
        `deciding()`) holds their lock; nothing otherwise."""
        if self.shared is None or not getattr(decision, "held", False):
            return []
        return self.shared.sent.siblings_sent(endpoints)

    def share_sent(self, decision, endpoint_id: str, keys, at: float = 0.0, prefill: float = 0.0) -> None:
        """Tell the sibling workers this request's prompt keys went to `endpoint_id` at `at`, needing
        `prefill` seconds there (under their lock)."""
        if self.shared is not None and getattr(decision, "held", False):
            self.shared.sent.append(endpoint_id, keys, at, prefill)

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
        them (the report must show those: the control plane waits for them before stopping)."""
        self.counts = {k: n for k, n in self.counts.items() if n > 0 or k in listed}
        self.ok_at = {k: t for k, t in self.ok_at.items() if k in self.counts}
        self.fail_at = {k: t for k, t in self.fail_at.items() if k in self.counts}
        self.changes = {k: v for k, v in self.changes.items() if k in self.counts}
        self.answers = [a for a in self.answers if a.endpoint in listed]

    def facts(self) -> tuple[dict, dict, dict, dict, dict]:
        """Copies for the gateway report: counts, ok_at, fail_at, per model, last request per model."""
        return (dict(self.counts), dict(self.ok_at), dict(self.fail_at), dict(self.by_model),
                dict(self.last_request_at))
