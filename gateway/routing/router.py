"""The router of one gateway process: the routing snapshot, the in-flight counts and the learner.

- `snapshot` (gateway.routing.tables.Snapshot) is replaced whole by its writers (a new endpoint
  list, a load refresh, an endpoint that refused a connection), one at a time under `write_lock`;
  the request path reads the reference and never waits for a writer.
- `route` chooses and reserves a slot (in-flight + 1) under `lock`, so concurrent requests see each
  other; `release` gives it back and notes the answer for the learner. Those counts
  (gateway.routing.inflight) are all a request changes.
- the learner's state changes only on a load refresh, by the pure gateway.routing.learn.

No I/O: what is read from Redis is handed in (gateway.server.pollers).
"""

from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import replace
from typing import Callable, Mapping, NamedTuple

from gateway.config import RoutingConfig
from gateway.routing.adapters import NO_ADAPTER, no_holder
from gateway.routing.backlog import PrefillBacklog
from gateway.routing.choice import Choice, Rejection, RouteContext, RouteRequest, choose, fleet_rate
from gateway.routing.othergateways import report_due
from gateway.routing.inflight import InFlight
from gateway.routing.kvindex import SharedIndex
from gateway.routing.learn import Learning, answer_sample, fold_answers, is_new, observe_loads
from gateway.routing.load import NO_STATS, EndpointStats
from gateway.routing.precise import Tokenize, cached_tokens, no_tokenizer
from gateway.routing.prefill import NO_TALLY, PrefixTally, reuse_of, trust_of
from gateway.routing.prefixindex import PrefixIndex
from gateway.routing.prefixkeys import TOKENS_PER_BLOCK
from gateway.routing.tables import EMPTY, Snapshot, Tables
from llmgw.state.clock import Clock
from llmgw.state.demand_records import GatewaySent
from llmgw.state.records import EndpointInfo, LoadRecord

# Sends kept for the other gateways while Redis does not take them (the oldest are dropped first:
# what they would have told the others is stale by then).
OUTBOX_MAX = 10_000


class Router:
    def __init__(self, cfg: RoutingConfig, clock: Clock, rng: random.Random, metrics=None, shared=None,
                 on_release: Callable[[str | None], None] = lambda model: None, tokenize: Tokenize = no_tokenizer):
        self.routing, self.clock, self.rng, self.metrics = cfg, clock, rng, metrics
        self.lock = threading.Lock()  # the in-flight counts
        self.write_lock = threading.Lock()  # one writer of the snapshot and the learner at a time
        self.snapshot: Snapshot = EMPTY
        self.counts = InFlight(shared)
        self._learning = Learning()
        self.rr_counter = 0
        self.prefixes = PrefixIndex()  # the block keys sent to each endpoint (under `lock`)
        self.backlog = PrefillBacklog()  # the prefill sent to each endpoint lately (under `lock`)
        # Precise mode: what the engines that publish KV events report holding (fed by
        # gateway.server.kvevents through its lock), and how a prompt is tokenized for each.
        self.kv = SharedIndex()
        self.tokenize = tokenize
        # Per endpoint, what was seen of its prefix cache (gateway.routing.prefill.PrefixTally).
        self.prefix_tally: dict[str, PrefixTally] = {}
        # What this process sent with prompt keys, for the other gateways (gateway.server.sendshare
        # drains it; None: not shared). Under `lock`.
        self.outbox: deque[GatewaySent] | None = None
        # What this gateway last told the others it holds, and when (take_holds; under `lock`).
        self._holds_said: dict[str, int] | None = None
        self._holds_said_at = float("-inf")
        # Per canonical model, when it last had an endpoint in the list (monotonic; `had_replica`).
        self._listed_at: dict[str, float] = {}
        # A slot of a model freed (its name), or the loads or tables changed (None): wakes the queues.
        self.on_release = on_release

    def share(self, table) -> None:
        """Count with the sibling workers' table (gateway.server.siblings): set before serving."""
        self.counts.shared = table

    @property
    def siblings(self):
        """The sibling workers' table (gateway.server.siblings.SharedCounts), None when counted alone."""
        return self.counts.shared

    # --- what the request path reads -------------------------------------------------------------
    @property
    def tables(self) -> Tables:
        return self.snapshot.tables

    @property
    def endpoints(self) -> tuple[EndpointInfo, ...]:
        return self.snapshot.tables.endpoints

    @property
    def loads(self) -> Mapping[str, LoadRecord]:
        return self.snapshot.loads

    @property
    def stats(self) -> Mapping[str, EndpointStats]:
        return self.snapshot.stats

    @property
    def inflight(self) -> Mapping[str, int]:
        return self.counts.counts

    @property
    def learning(self) -> Learning:
        """What was learned so far, the answers since the last load refresh included."""
        with self.lock:
            answers = list(self.counts.answers)
        return fold_answers(self._learning, answers, self.routing.learn_half_life)

    def held(self, now: float, model: str | None = None) -> Mapping[str, int]:
        return self.counts.held(self.snapshot.tables.endpoints, now, model)

    def completion_rate(self, model: str) -> float | None:
        """Requests per second the model's endpoints complete when full (None: not known yet)."""
        snap = self.snapshot
        return fleet_rate(snap.tables.endpoints, snap.stats, model)

    # --- the request path ---------------------------------------------------------------------------
    def route(self, req: RouteRequest) -> Choice | Rejection:
        """Choose and reserve (in-flight + 1) atomically, so concurrent requests see each other. A
        request for a LoRA adapter goes only to the endpoints holding it, chosen among as usual."""
        snap = self.snapshot
        adapters = snap.tables.adapters
        ad = adapters.get(req.model) if adapters else None
        if ad is None:
            return self._reserve(snap.tables.endpoints, req, snap, None)
        if not ad.holders:
            return Rejection(NO_ADAPTER, req.model, no_holder(ad))
        # (Built directly: dataclasses.replace costs microseconds on the request path.)
        sub = RouteRequest(ad.model, req.priority, req.affinity, req.exclude, req.queued, op=req.op, pin=req.pin,
                           waited=req.waited, prefix=req.prefix, prompt_tokens=req.prompt_tokens,
                           objective=req.objective, opens=req.opens)
        res = self._reserve(ad.holders, sub, snap, ad.name, req)
        if isinstance(res, Rejection):
            if res.kind == "unknown_model":  # none of them is the one its response id pins it to
                return Rejection(NO_ADAPTER, req.model, f"the endpoint {req.pin} does not hold adapter {ad.name!r}")
            if res.kind == "no_ready":  # every holder failed it (one died): it waits for a load, or the holder's return
                return Rejection(NO_ADAPTER, req.model, f"every replica holding adapter {ad.name!r} failed this request")
            return replace(res, model=req.model)
        return res

    def _reserve(self, endpoints, req: RouteRequest, snap: Snapshot, adapter: str | None,
                 asked: RouteRequest | None = None) -> Choice | Rejection:
        """Choose among `endpoints` and reserve the slot, under the lock (and the sibling workers'):
        the one place a request changes what this gateway holds and where it sent what. `adapter`:
        the LoRA adapter the request names (`asked` is its request as made, for the engines' KV
        events, which name the adapter)."""
        now = self.clock.monotonic()
        exact = self._engine_held(endpoints, asked or req, adapter) if snap.tables.precise else None
        with self.lock, self.counts.deciding() as decision:  # the sibling workers decide one at a time too
            if req.prefix:
                self._learn_siblings_sent(decision, snap)
            matched = self.prefixes.matches(snap.tables.by_id, req.prefix) if req.prefix else None
            if exact:
                matched = {**(matched or {}), **exact}
            ctx = RouteContext(endpoints, snap.loads, self.counts.held(endpoints, now, req.model), now, self.rng,
                               self.routing, snap.stats, self.rr_counter, matched,
                               frozenset(exact) if exact else frozenset(),
                               self.backlog.ahead(snap.tables.by_id if adapter is None else [e.id for e in endpoints],
                                                  now))
            res = choose(ctx, req)
            if isinstance(res, Choice):
                self.rr_counter += 1
                if adapter is not None or (exact and res.endpoint.id in exact):
                    res = _reserved(res, adapter or "", bool(exact and res.endpoint.id in exact))
                self.counts.add(res.endpoint, self.clock.time(), now, adapter or "")
                self.backlog.add(res.endpoint.id, res.prefill, now)
                if req.prefix:
                    self.prefixes.sent(res.endpoint.id, req.prefix)
                    self.counts.share_sent(decision, res.endpoint.id, req.prefix, now, res.prefill)
                    self._post(res.endpoint.id, req.prefix, res.prefill)
                    if adapter is None:
                        self._tally(res)
        if isinstance(res, Choice) and self.metrics:
            self.metrics.child(self.metrics.inflight, res.endpoint.id).inc()
        return res

    def _learn_siblings_sent(self, decision, snap: Snapshot) -> None:
        """What the sibling workers sent since the last decision, into our prefix index: the whole
        gateway's traffic, so a conversation's next turn finds its history whichever worker takes it.
        And into the prefill backlog, from when each was sent (the workers share the host's
        monotonic clock): a send long past has drained and adds nothing."""
        for sent in self.counts.siblings_sent(decision, snap.tables.by_id):
            self.prefixes.sent(sent.endpoint, sent.keys)
            self.backlog.add(sent.endpoint, sent.prefill, sent.at)

    def _post(self, endpoint_id: str, keys, prefill: float) -> None:
        if self.outbox is not None:
            self.outbox.append(GatewaySent(endpoint_id, keys, self.clock.time(), prefill))

    def share_sends(self) -> None:
        """Keep what this process sends for the other gateways from now on (`take_sends`)."""
        with self.lock:
            if self.outbox is None:
                self.outbox = deque(maxlen=OUTBOX_MAX)

    def take_sends(self) -> list[GatewaySent]:
        """What this process sent since the last call, oldest first."""
        with self.lock:
            if not self.outbox:
                return []
            out = list(self.outbox)
            self.outbox.clear()
            return out

    def learn_sends(self, sends: list[GatewaySent]) -> None:
        """What the other gateways sent (gateway.server.sendshare read it from Redis), into our prefix
        index and prefill backlog, as a sibling worker's sends are: so the next turn of a conversation
        that another gateway served finds its history here too. Their wall clock times become ours
        by their age; a send long past has drained and adds no backlog."""
        if not sends:
            return
        snap = self.snapshot
        listed = snap.tables.by_id
        now, wall = self.clock.monotonic(), self.clock.time()
        with self.lock:
            for s in sends:
                if s.endpoint in listed:
                    self.prefixes.sent(s.endpoint, s.keys)
                    self.backlog.add(s.endpoint, s.prefill, now - max(0.0, wall - s.at))

    def take_holds(self) -> dict[str, int] | None:
        """What this gateway holds per endpoint (its workers together), for the other gateways, when
        it is time to say it (gateway.routing.othergateways.report_due); None otherwise. The benchmark
        baselines (`LLMGW_GATEWAY_POLICY`) say nothing: they stand for peers whose instances share
        nothing."""
        if self.routing.policy != "llmgw":
            return None
        now = self.clock.monotonic()
        with self.lock:
            counts = self.counts.gateway_held(self.snapshot.tables.by_id, now)
            if not report_due(counts, self._holds_said, self._holds_said_at, now):
                return None
            self._holds_said, self._holds_said_at = counts, now
            return counts

    def learn_holds(self, origin: str, counts: Mapping[str, int], at: float) -> None:
        """Another gateway (`origin`) held `counts` at `at` (its wall clock): counted from now on as
        its sibling workers' are (gateway.routing.othergateways), until it says otherwise or goes silent."""
        now = self.clock.monotonic()
        listed = self.snapshot.tables.by_id
        mine = {e: int(n) for e, n in counts.items() if e in listed and n > 0}
        with self.lock:
            self.counts.remote.learn(origin, mine, now - max(0.0, self.clock.time() - at), now)

    def remote_held(self) -> dict[str, int]:
        """Per listed endpoint, what the other gateways said they hold there now (0: nothing)."""
        ids = list(self.snapshot.tables.by_id)
        with self.lock:
            held = self.counts.remote.others(ids, self.clock.monotonic())
        return {i: held.get(i, 0) for i in ids}

    def release(self, choice: Choice, service_time: float | None, tokens: int | None = None,
                ttfb: float | None = None) -> None:
        """The request left the endpoint. If it completed normally it is learned from once, on the
        next load refresh (gateway.routing.learn.answer_sample says what is kept of it)."""
        ep = choice.endpoint
        now = self.clock.monotonic()
        snap = self.snapshot
        if ttfb is not None and (choice.prefill or choice.behind):
            # The time to first byte learned is the engine's own (a step, the network): the prompt
            # work this request did and waited for there is what `choose` adds to it by itself, so
            # an engine that was sent more misses does not look slower to every later request.
            ttfb = max(0.0, ttfb - choice.prefill - choice.behind)
        with self.lock:
            ours = self.counts.remove(ep, self.clock.time(), now, choice.adapter)
            if service_time is not None and service_time > 0:
                held = ours + self.counts.siblings(ep.id, now)  # with the other workers and gateways, as choice.ahead
                self.counts.answers.append(answer_sample(ep, choice.ahead, held, service_time, tokens, ttfb,
                                                         snap.loads.get(ep.id), snap.stats.get(ep.id), now,
                                                         self.routing))
        if self.metrics:
            self.metrics.child(self.metrics.inflight, ep.id).dec()
        self.on_release(ep.model or ep.models[0])

    def _engine_held(self, endpoints, req: RouteRequest, adapter: str | None) -> dict[str, float] | None:
        """Precise mode: per endpoint that publishes KV events (and was heard from), the prompt's
        cached part by the engine's own account, in the block keys `choose` counts (a prompt's
        prefix keys are TOKENS_PER_BLOCK tokens each)."""
        if req.body is None:
            return None
        with self.kv.lock:
            held = cached_tokens(self.kv.index, endpoints, req.op, req.body, self.tokenize, adapter)
        return {i: n / TOKENS_PER_BLOCK for i, n in held.items()} if held else None

    def _tally(self, c: Choice) -> None:
        t = self.prefix_tally.get(c.endpoint.id, NO_TALLY)
        self.prefix_tally[c.endpoint.id] = PrefixTally(t.routed + c.prompt, t.expected + c.matched, t.answered, t.reused)

    def reused(self, endpoint_id: str, prompt: int, cached: int) -> None:
        """An answer said how much of its prompt the engine reused (llama.cpp's timings.cache_n)."""
        with self.lock:
            t = self.prefix_tally.get(endpoint_id, NO_TALLY)
            self.prefix_tally[endpoint_id] = PrefixTally(t.routed, t.expected, t.answered + prompt, t.reused + cached)

    def prefix_facts(self) -> dict[str, PrefixTally]:
        with self.lock:
            return dict(self.prefix_tally)

    def mark_unreachable(self, endpoint_id: str) -> None:
        """The endpoint refused a connection: pass it over for `eject_for` seconds (choice.eligible)."""
        self.counts.fail_at[endpoint_id] = self.clock.time()
        with self.write_lock:
            snap = self.snapshot
            st = replace(snap.stats.get(endpoint_id, NO_STATS), down_until=self.clock.monotonic() + self.routing.eject_for)
            self.snapshot = replace(snap, stats={**snap.stats, endpoint_id: st})

    def timed_out(self, endpoint_id: str) -> None:
        """The endpoint accepted a request but sent nothing in time: evidence against it."""
        self.counts.fail_at[endpoint_id] = self.clock.time()

    def answered(self, endpoint_id: str) -> None:
        """A response head arrived from the endpoint: evidence that it serves."""
        self.counts.ok_at[endpoint_id] = self.clock.time()

    def had_replica(self, model: str, within: float = 600.0) -> bool:
        """Whether `model` (its canonical name) has an endpoint in the list, or had one within the last
        `within` seconds (its replicas are restarting rather than never placed)."""
        if any(model in e.models for e in self.snapshot.tables.endpoints):
            return True
        at = self._listed_at.get(model)
        return at is not None and self.clock.monotonic() - at <= within

    def requested(self, model: str) -> None:
        """A request for a known model arrived (demand, even when nothing can serve it yet)."""
        self.counts.last_request_at[self.snapshot.tables.canonical.get(model, model)] = self.clock.time()

    # --- writers ------------------------------------------------------------------------------------
    def apply_tables(self, tables: Tables, new_list: bool) -> None:
        """Route by `tables` from now on. With `new_list` (not just the catalog's names changed) the
        loads, stats, counts and samples of endpoints that left the list are forgotten."""
        with self.write_lock:
            snap = self.snapshot
            if not new_list:
                self.snapshot = Snapshot(tables, snap.loads, snap.stats)
                self.on_release(None)  # new names (an adapter loaded, a model renamed) may free a waiter
                return
            listed = tables.by_id
            now = self.clock.monotonic()
            for m in {e.model or e.models[0] for e in tables.endpoints}:
                self._listed_at[m] = now
            with self.lock:
                self.counts.prune(listed)
                self.prefixes.listed({i: ep.kv_tokens for i, ep in listed.items()})
                self.backlog.keep(listed)
                for i in [i for i in self.prefix_tally if i not in listed]:
                    del self.prefix_tally[i]
            self._learning = self._learning.keep(listed)
            self.snapshot = Snapshot(tables, {k: v for k, v in snap.loads.items() if k in listed},
                                     {k: v for k, v in snap.stats.items() if k in listed})
        self.on_release(None)

    def renumber(self, version: int) -> None:
        """The list's version counter went backwards (Redis lost its data): keep the list, take the
        next one published whatever its number."""
        with self.write_lock:
            self.snapshot = replace(self.snapshot, tables=replace(self.snapshot.tables, version=version))

    def apply_loads(self, loads: Mapping[str, LoadRecord]) -> None:
        """The endpoints' LoadRecords as just read: learn from the new ones and the answers since the
        last refresh, then route by them."""
        with self.write_lock:
            snap = self.snapshot
            seen, wall = self.clock.monotonic(), self.clock.time()
            counts = self.counts
            with self.lock:
                # The sibling workers' and the other gateways' part of what the scrapes show: the most
                # each held lately (what they held when a scrape was taken, or more).
                sib = counts.others_recent(list(loads), seen)
                # What we held when each new record was scraped (some time in the last two refresh
                # intervals, when we may have held more than now): our own requests that ended
                # since must not count as another gateway's, or they fill the endpoint with phantoms.
                held = {i: counts.held_at(i, rec.ts, wall) + sib.get(i, 0)
                        for i, rec in loads.items() if is_new(i, rec, snap.loads)}
                answers = counts.take_answers()
            self._learning, stats = observe_loads(self._learning, loads, snap.loads, snap.stats, held, answers,
                                                  snap.tables.by_id, seen, self.routing)
            with self.lock:
                trust = {i: (trust_of(t), reuse_of(t)) for i, t in self.prefix_tally.items()}
                self.prefixes.reports({i: rec.kv_tokens for i, rec in loads.items()
                                       if rec.kv_tokens and i in snap.tables.by_id})
            stats = {i: _with_tally(st, *trust[i]) if i in trust else st for i, st in stats.items()}
            self.snapshot = Snapshot(snap.tables, loads, stats)
        self.on_release(None)

    def fold_answers(self) -> None:
        """A refresh that read no loads still learns from the answers since the last one."""
        with self.write_lock:
            with self.lock:
                answers = self.counts.take_answers()
            self._learning = fold_answers(self._learning, answers, self.routing.learn_half_life)

    def report_facts(self) -> "ReportFacts":
        """A consistent copy for the gateway report: the list's version, then `InFlight.facts`."""
        with self.lock:
            return ReportFacts(self.snapshot.tables.version, *self.counts.facts())


def _reserved(c: Choice, adapter: str, kv_events: bool) -> Choice:
    """`c` routed for `adapter`, its match reported by the engine's KV events or not."""
    # (Built directly: dataclasses.replace costs microseconds on the request path.)
    return Choice(c.endpoint, c.score, c.ahead, c.saturated, c.reason, adapter, c.matched, c.saved, c.prompt,
                  kv_events, c.prefill, c.behind, c.waited)


class ReportFacts(NamedTuple):
    """What the gateway report says of this process's requests, copied at one instant."""

    version: int  # the endpoint list routed by
    inflight: dict[str, int]  # per endpoint
    ok_at: dict[str, float]  # per endpoint, the last response head (wall clock)
    fail_at: dict[str, float]  # per endpoint, the last connection failure or first-byte timeout
    by_model: dict[str, int]  # requests in flight per canonical model name
    last_request_at: dict[str, float]  # per canonical model name


class Lease:
    """One reserved in-flight slot on an endpoint; `release` gives it back once, however often called
    (the request path's `finally` and the answer's completion may both reach it)."""

    __slots__ = ("router", "choice", "done")

    def __init__(self, router: Router, choice: Choice):
        self.router, self.choice, self.done = router, choice, False

    def release(self, service_time: float | None = None, tokens: int | None = None,
                ttfb: float | None = None) -> None:
        if not self.done:
            self.done = True
            self.router.release(self.choice, service_time, tokens, ttfb)


def _with_tally(st: EndpointStats, trust: float, reuse: float | None) -> EndpointStats:
    """`st` with what the answers said of the engine's prefix cache: how far it kept what was expected,
    and how much of the prompts it reused (the same measure as its counters', which llama.cpp lacks)."""
    reuse = reuse if reuse is not None else st.reuse
    if trust == st.prefix_trust and reuse == st.reuse:
        return st
    return replace(st, prefix_trust=trust, reuse=reuse)
