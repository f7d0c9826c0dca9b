"""The router of one gateway process, as the request path uses it: the routing snapshot, the slots it
reserves and releases, and the learner.

- `snapshot` (gateway.routing.tables.Snapshot) is replaced whole by its writers (a new endpoint
  list, a load refresh, an endpoint that refused a connection), one at a time under `write_lock`;
  the request path reads the reference and never waits for a writer.
- `route` chooses and reserves a slot (in-flight + 1) under the in-flight counts' own lock
  (gateway.routing.inflight), so concurrent requests see each other; `release` gives it back and
  notes the answer for the learner. Those counts are all a request changes.
- the learner's state changes only on a load refresh, by the pure gateway.routing.learn.

Its parts are given whole when it is made (gateway.app): the counts, the engines' KV events index
(fed by gateway.server.kvevents), the tokenizer. What the gateways tell each other over the same
counts is gateway.routing.exchange's; what is read from Redis is handed in by gateway.server.pollers.
No I/O.
"""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from typing import Callable, Mapping

from gateway.config import RoutingConfig
from gateway.routing.adapters import NO_ADAPTER, no_holder
from gateway.routing.choice import Choice, Rejection, RouteContext, RouteRequest, choose, fleet_rate, policy_of
from gateway.routing.inflight import InFlight
from gateway.routing.kvindex import SharedIndex
from gateway.routing.learn import Learning, answer_sample, fold_answers, is_new, observe_loads
from gateway.routing.load import NO_STATS, EndpointStats
from gateway.routing.precise import Tokenize, cached_tokens, no_tokenizer
from gateway.routing.prefill import reuse_of, trust_of
from gateway.routing.prefixkeys import TOKENS_PER_BLOCK
from gateway.routing.tables import EMPTY, Snapshot, Tables
from llmgw.state.clock import Clock
from llmgw.state.records import EndpointInfo, LoadRecord


class Router:
    """`counts`: this process's in-flight counts (given its sibling workers' table, and its outbox
    when its sends are shared); `kv`: what the engines that publish KV events report holding
    (precise mode), `tokenize` how a prompt is tokenized for each; `on_release`: a slot of a model
    freed (its name), or the loads or tables changed (None): wakes the queues."""

    def __init__(self, cfg: RoutingConfig, clock: Clock, rng: random.Random, counts: InFlight | None = None,
                 kv: SharedIndex | None = None, tokenize: Tokenize = no_tokenizer, metrics=None,
                 on_release: Callable[[str | None], None] = lambda model: None):
        self.routing, self.clock, self.rng, self.metrics = cfg, clock, rng, metrics
        self.counts = counts if counts is not None else InFlight()
        self.kv = kv if kv is not None else SharedIndex()
        self.tokenize = tokenize
        self.on_release = on_release
        self.policy = policy_of(cfg.policy)  # this router's instance (round robin keeps its turn in it)
        self.write_lock = threading.Lock()  # one writer of the snapshot and the learner at a time
        self.snapshot: Snapshot = EMPTY
        self._learning = Learning()
        # Per canonical model, when it last had an endpoint in the list (monotonic; `had_replica`).
        self._listed_at: dict[str, float] = {}

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
        with self.counts.lock:
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
                           objective=req.objective, opens=req.opens, slo=req.slo, granted=req.granted,
                           continuation=req.continuation)
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
        """Choose among `endpoints` and reserve the slot, under the counts' lock (and the sibling workers'):
        the one place a request changes what this gateway holds and where it sent what. `adapter`:
        the LoRA adapter the request names (`asked` is its request as made, for the engines' KV
        events, which name the adapter)."""
        now = self.clock.monotonic()
        exact = None
        if snap.tables.precise:
            exact, length = self._engine_held(endpoints, asked or req, adapter)
            if length and req.prompt_tokens and length != req.prompt_tokens:
                req = replace(req, prompt_tokens=length)  # the engines' own count, not the body's estimate
        counts = self.counts
        with counts.lock, counts.deciding() as decision:  # the sibling workers decide one at a time too
            if req.prefix:
                counts.learn_siblings_sent(decision, snap.tables.by_id)
            matched = counts.prefixes.matches(snap.tables.by_id, req.prefix) if req.prefix else None
            if exact:
                matched = {**(matched or {}), **exact}
            held = counts.held(endpoints, now, req.model)
            ctx = RouteContext(endpoints, snap.loads, held, now, self.rng,
                               self.routing, snap.stats, self.policy, matched,
                               frozenset(exact) if exact else frozenset(),
                               counts.backlog.ahead(snap.tables.by_id if adapter is None else [e.id for e in endpoints],
                                                    now))
            res = choose(ctx, req)
            if isinstance(res, Choice):
                idle = not held.get(res.endpoint.id, 0)  # before it counts this one (`held` may be the live counts)
                if adapter is not None or (exact and res.endpoint.id in exact):
                    res = _reserved(res, adapter or "", bool(exact and res.endpoint.id in exact))
                wall = self.clock.time()
                counts.add(res.endpoint, wall, now, adapter or "")
                counts.backlog.add(res.endpoint.id, res.prefill, now, idle)
                if req.prefix:
                    counts.sent(res, req.prefix, adapter is None, decision, wall, now)
        if isinstance(res, Choice) and self.metrics:
            self.metrics.child(self.metrics.inflight, res.endpoint.id).inc()
        return res

    def release(self, choice: Choice, service_time: float | None, tokens: int | None = None,
                ttfb: float | None = None) -> None:
        """The request left the endpoint. If it completed normally it is learned from once, on the
        next load refresh (gateway.routing.learn.answer_sample says what is kept of it)."""
        ep = choice.endpoint
        now = self.clock.monotonic()
        snap = self.snapshot
        with self.counts.lock:
            ours = self.counts.remove(ep, self.clock.time(), now, choice.adapter)
            if service_time is not None and service_time > 0:
                held = ours + self.counts.siblings(ep.id, now)  # with the other workers and gateways, as choice.ahead
                a = answer_sample(ep, choice.ahead, held, service_time, tokens, ttfb, snap.loads.get(ep.id),
                                  snap.stats.get(ep.id), now, self.routing, choice.prefill + choice.behind)
                if a is not None:
                    self.counts.answers.append(a)
        if self.metrics:
            self.metrics.child(self.metrics.inflight, ep.id).dec()
        self.on_release(ep.model or ep.models[0])

    def lend(self, endpoint_id: str) -> Callable[[], None] | None:
        """Hold a slot of `endpoint_id` for another gateway's request (gateway.server.remote_evictions
        paused one of our answers for it) until the call returned gives it back: counted as ours
        meanwhile, so our waiting requests leave that slot to it until its gateway reports it. None:
        the endpoint is not listed."""
        ep = self.snapshot.tables.by_id.get(endpoint_id)
        if ep is None:
            return None
        with self.counts.lock:
            self.counts.add(ep, self.clock.time(), self.clock.monotonic())

        def give_back() -> None:
            with self.counts.lock:
                self.counts.remove(ep, self.clock.time(), self.clock.monotonic())
            self.on_release(ep.model or ep.models[0])
        return give_back

    def _engine_held(self, endpoints, req: RouteRequest, adapter: str | None
                     ) -> tuple[dict[str, float] | None, int | None]:
        """Precise mode: per endpoint that publishes KV events (and was heard from), the prompt's
        cached part by the engine's own account, in the block keys `choose` counts (a prompt's
        prefix keys are TOKENS_PER_BLOCK tokens each); and the prompt's length in those engines'
        tokens (None: not known)."""
        if req.body is None:
            return None, None
        with self.kv.lock:
            held, length = cached_tokens(self.kv.index, endpoints, req.op, req.body, self.tokenize, adapter)
        return ({i: n / TOKENS_PER_BLOCK for i, n in held.items()} if held else None), length

    def reused(self, endpoint_id: str, prompt: int, cached: int) -> None:
        """An answer said how much of its prompt the engine reused (llama.cpp's timings.cache_n)."""
        self.counts.reused(endpoint_id, prompt, cached)

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
            with self.counts.lock:
                self.counts.prune(listed)
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
            with counts.lock:
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
            with counts.lock:
                trust = {i: (trust_of(t), reuse_of(t)) for i, t in counts.tally.items()}
                counts.prefixes.reports({i: rec.kv_tokens for i, rec in loads.items()
                                         if rec.kv_tokens and i in snap.tables.by_id})
            stats = {i: _with_tally(st, *trust[i]) if i in trust else st for i, st in stats.items()}
            self.snapshot = Snapshot(snap.tables, loads, stats)
        self.on_release(None)

    def fold_answers(self) -> None:
        """A refresh that read no loads still learns from the answers since the last one."""
        with self.write_lock:
            with self.counts.lock:
                answers = self.counts.take_answers()
            self._learning = fold_answers(self._learning, answers, self.routing.learn_half_life)


def _reserved(c: Choice, adapter: str, kv_events: bool) -> Choice:
    """`c` routed for `adapter`, its match reported by the engine's KV events or not."""
    # (Built directly: dataclasses.replace costs microseconds on the request path.)
    return Choice(c.endpoint, c.score, c.ahead, c.saturated, c.reason, adapter, c.matched, c.saved, c.prompt,
                  kv_events, c.prefill, c.behind, c.waited, c.predicted_ttft, c.predicted_tpot, c.predicted_total,
                  c.runner_up)


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
