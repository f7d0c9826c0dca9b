"""The gateway's in-memory tables, refreshed in the background, never per request.

- endpoints: reloaded when `Store.endpoints_version()` changes (polled every ~0.5 s, woken early by
  the pub/sub hint);
- loads: one MGET of the endpoints' LoadRecords every ~0.5 s;
- in-flight counts: updated by the request path itself, and shared with the other gunicorn workers
  of this gateway (gateway.siblings), so routing counts what the whole gateway holds;
- each endpoint's speed (gateway.speed): per-token times from two consecutive LoadRecords' token
  counters, and, once per finished request, its decode time (elapsed minus time to first byte) and
  tokens per second when the answer reported usage. Nothing is measured per chunk.
- what the gateway report tells the control plane (gateway.report): in flight per endpoint and per
  model, the last request per model, and per endpoint the wall clock of the last response head and
  of the last failure to reach it. Counts change under the lock the request path already takes to
  route and release; the timestamps are single dict stores (atomic between greenlets and threads).

The loops are threads; under gunicorn's gevent worker (gateway.gunicorn_conf) `threading` is
monkey-patched, so each is a greenlet and every wait in them yields to the request path.

When Redis cannot be reached the last tables stay in use (static stability): the outage is logged
once, shown by /healthz and a metric, and the loops recover by themselves when Redis answers again.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections import deque
from dataclasses import replace
from typing import Callable, Mapping

import redis

from gateway import siblings
from gateway.config import GatewaySettings
from gateway.report import Identity, gateway_report
from gateway.responses import endpoint_ref
from gateway.routing import (
    Choice,
    EndpointStats,
    Rejection,
    RouteRequest,
    ahead_of,
    choose,
    fleet_rate,
    fresh_load,
    slots_of,
)
from gateway.speed import Fit, Speed, shrink
from llmgw.catalog import catalog_outline, key_variables
from llmgw.state.clock import Clock
from llmgw.state.records import EndpointInfo, GatewayReport, LoadRecord
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

REDIS_ERRORS = (redis.exceptions.RedisError, OSError)
EWMA_ALPHA = 0.25  # time to first byte, per endpoint
TOKENS_ALPHA = 0.05  # tokens per answer, fleet-wide
CHANGES_KEPT = 512  # changes of our in-flight count kept per endpoint (seconds of traffic)
STALE_SCRAPE = 10.0  # a LoadRecord scraped longer ago than this (by its ts) is not matched to our count
CLOCK_SLACK = 1.0  # tolerated lead of the agent's clock over ours (NTP keeps them within milliseconds)
FULL_RELOAD_EVERY = 30.0  # seconds


def name_table(catalog: list[tuple[str, ...]], endpoints) -> dict[str, frozenset[str]]:
    """Name or alias -> all names of its model, from the catalog's models and the endpoints' lists."""
    groups = [frozenset(names) for names in catalog] + [frozenset(e.models) for e in endpoints]
    out: dict[str, frozenset[str]] = {}
    for g in groups:
        for n in g:
            out[n] = out.get(n, frozenset()) | g
    return out


class RedisHealth:
    """Tracks whether Redis answers; logs each transition once (not per failed call)."""

    def __init__(self, clock: Clock, on_change: Callable[[bool], None] = lambda ok: None):
        self.clock = clock
        self.ok = True
        self.down_since: float | None = None
        self.last_error = ""
        self.on_change = on_change
        self._lock = threading.Lock()

    def failed(self, err: BaseException) -> None:
        with self._lock:
            self.last_error = f"{type(err).__name__}: {err}"
            if self.ok:
                self.ok = False
                self.down_since = self.clock.time()
                log.warning("redis unavailable (%s); serving from the last endpoint list", self.last_error)
                self.on_change(False)

    def succeeded(self) -> None:
        if self.ok:
            return
        with self._lock:
            if not self.ok:
                down = self.clock.time() - (self.down_since or self.clock.time())
                self.ok, self.down_since = True, None
                log.warning("redis reachable again after %.1fs", down)
                self.on_change(True)


class Learned:
    """The samples behind one endpoint's Speed (gateway.speed). Changed in place under the state's
    lock by the request path (one sample per finished request) and the load refresh (one per scrape);
    the Speed the router reads is derived from them on each load refresh, not per request."""

    __slots__ = ("per_token", "per_request", "ttfb", "last")

    def __init__(self) -> None:
        self.per_token = Fit()  # seconds per token per stream vs concurrency (scrapes; answers with usage)
        self.per_request = Fit()  # decode seconds per answer vs concurrency (every answer)
        self.ttfb: float | None = None  # smoothed time to first byte of requests that found a free slot
        self.last = 0.0  # when the last sample came (the state's monotonic clock)


class GatewayState:
    """Endpoint list, loads, in-flight counts and learned speeds, behind one lock."""

    def __init__(self, store: Store, cfg: GatewaySettings, clock: Clock | None = None, metrics=None,
                 rng: random.Random | None = None, environ: Mapping[str, str] | None = None,
                 shared: siblings.SharedCounts | None = None):
        self.store = store
        # The sibling workers' counts (None: this process routes alone); see gateway.siblings.
        self.shared = shared if shared is not None else siblings.table
        # Where the API keys of external servers are read from (`api_key_env` names a variable here).
        self.environ = os.environ if environ is None else environ
        self.cfg = cfg
        self.clock = clock or Clock()
        self.metrics = metrics
        self.rng = rng or random.Random(cfg.seed)
        self.lock = threading.Lock()
        self.health = RedisHealth(self.clock, self._redis_changed)
        self.version = 0
        self.fingerprint = ""
        self._last_full = float("-inf")
        self.endpoints: tuple[EndpointInfo, ...] = ()  # what routing chooses from
        self.by_id: dict[str, EndpointInfo] = {}  # every listed endpoint, those missing their key too
        self.by_ref: dict[bytes, EndpointInfo] = {}  # by the digest response ids carry (gateway.responses)
        self.api_keys: dict[str, str] = {}  # endpoint id -> the key sent to it (its api_key_env's value)
        # endpoint id -> the variable it needs and this process lacks: not routed to (503 when alone).
        self.missing_keys: dict[str, str] = {}
        self._warned: set[tuple[str, str, str]] = set()
        self.loads: dict[str, LoadRecord] = {}
        self.inflight: dict[str, int] = {}  # this process's own; kept for endpoints that left the list while in flight
        self.ok_at: dict[str, float] = {}  # wall clock of the last response head per endpoint
        self.fail_at: dict[str, float] = {}  # ... of the last connection failure or first-byte timeout
        self.model_inflight: dict[str, int] = {}  # by canonical model name
        self.last_request_at: dict[str, float] = {}  # by canonical name (the requested one if unpublished)
        self.canonical: dict[str, str] = {}  # alias or name -> canonical model name (catalog and list)
        # Names of models that scale to zero -> how long a request waits for a cold start (the catalog's
        # `autoscale.cold_start_timeout`; gateway.coldstart).
        self.cold_start: dict[str, float] = {}
        # Per endpoint, the last changes of our in-flight count: (wall clock, count before, after),
        # so a LoadRecord is compared with what we held when it was scraped (its `ts`).
        self.changes: dict[str, deque[tuple[float, int, int]]] = {}
        self.stats: dict[str, EndpointStats] = {}
        self.learned: dict[str, Learned] = {}
        # Names in the applied catalog or the published list: 503 (no Ready replica), not 404. A model
        # removed from the catalog becomes unknown again once its endpoints are unpublished.
        self.known_models: set[str] = set()
        # Name or alias -> every name of its model (catalog and published list): a key's `--models`
        # may list any of them (gateway.policy).
        self.names: dict[str, frozenset[str]] = {}
        self.loaded_once = False
        self.rr_counter = 0
        self.tokens_per_request: float | None = None  # completion tokens per answer (usage), smoothed
        # ... and, while no answer reports usage, as implied by decode times and per-token speeds.
        self.tokens_estimate: float | None = None
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.on_release: Callable[[], None] = lambda: None  # wakes the wait queues
        self.on_loaded: Callable[[], None] = lambda: None  # a new endpoint list is in use (report it)

    # --- background refreshes ------------------------------------------------------------------
    def _redis_changed(self, ok: bool) -> None:
        if self.metrics:
            self.metrics.redis_unavailable.set(0 if ok else 1)

    def refresh_endpoints(self, force: bool = False) -> bool:
        """Reload the endpoint list if its version changed; True if it did. Never raises."""
        # After an outage the counter may have restarted (Redis lost its data), and a long-lived
        # process re-reads now and then anyway: an equal version number is then not proof of equality.
        now = self.clock.monotonic()
        force = force or not self.health.ok or now - self._last_full >= FULL_RELOAD_EVERY
        try:
            version = self.store.endpoints_version()
            if version < self.version:
                # The counter went backwards: Redis lost its data. Keep serving the list we have, and
                # take whatever is published next, whatever its number.
                self.version = version
            if version == self.version and not force and self.loaded_once:
                self.health.succeeded()
                return False
            v, fp, eps = self.store.read_endpoints()
            outline = catalog_outline(self.store)
            self._warn_missing_keys(key_variables(self.store))
            self.health.succeeded()
            self._last_full = now
        except REDIS_ERRORS as e:
            self.health.failed(e)
            return False
        except (ValueError, TypeError, KeyError) as e:  # a malformed document: keep the last good list
            log.error("cannot read the endpoint list: %s", e)
            return False
        if v == 0 and self.endpoints:
            # Redis came back empty (restarted without data): keep serving until it is republished.
            return False
        if self.loaded_once and v == self.version and fp == self.fingerprint:
            with self.lock:
                self.names = name_table(outline.groups, self.by_id.values())
                self.known_models = set(self.names)
                self.canonical = {**outline.canonical, **{n: e.model or e.models[0] for e in self.endpoints
                                                          for n in e.models}}
                self.cold_start = outline.cold_start
            return False
        api_keys, missing = self._keys_of(eps)
        with self.lock:
            self.version, self.fingerprint = v, fp
            self.endpoints = tuple(e for e in eps if e.id not in missing)
            self.by_id = {e.id: e for e in eps}
            self.by_ref = {endpoint_ref(e.id): e for e in eps}
            self.api_keys, self.missing_keys = api_keys, missing
            self.names = name_table(outline.groups, eps)
            self.known_models = set(self.names)
            self.loads = {k: v for k, v in self.loads.items() if k in self.by_id}
            self.stats = {k: v for k, v in self.stats.items() if k in self.by_id}
            # An endpoint that left the list stays while requests are in flight on it (the report
            # must show them: the control plane waits for them before stopping its replica).
            self.inflight = {k: n for k, n in self.inflight.items() if n > 0 or k in self.by_id}
            self.ok_at = {k: t for k, t in self.ok_at.items() if k in self.inflight}
            self.fail_at = {k: t for k, t in self.fail_at.items() if k in self.inflight}
            self.canonical = {**outline.canonical, **{n: e.model or e.models[0] for e in eps for n in e.models}}
            self.cold_start = outline.cold_start
            self.learned = {k: v for k, v in self.learned.items() if k in self.by_id}
            self.changes = {k: v for k, v in self.changes.items() if k in self.inflight}
            self.loaded_once = True
        if self.metrics:
            self.metrics.endpoints_version.set(v)
            self.metrics.endpoints.set(len(eps))
        log.info("endpoint list version %d: %d endpoints", v, len(eps))
        self.on_loaded()
        self.on_release()
        return True

    def _keys_of(self, eps: list[EndpointInfo]) -> tuple[dict[str, str], dict[str, str]]:
        """The key each endpoint gets, and the endpoints whose variable is not set here."""
        keys_, missing = {}, {}
        for e in eps:
            if e.api_key_env:
                value = self.environ.get(e.api_key_env)
                if value:
                    keys_[e.id] = value
                else:
                    missing[e.id] = e.api_key_env
                    self._warn_missing_keys([(e.model, e.profile, e.api_key_env)])
        return keys_, missing

    def _warn_missing_keys(self, wanted: list[tuple[str, str, str]]) -> None:
        """Once per process and variable: a profile's key variable is not in this environment (its
        endpoints get 503s, never another endpoint's key). The value itself is never logged."""
        for model, profile, var in wanted:
            if not self.environ.get(var) and (model, profile, var) not in self._warned:
                self._warned.add((model, profile, var))
                log.warning("environment variable %s is not set: requests that only external profile %s/%s "
                            "could serve get 503 from this gateway until it is started with %s set",
                            var, model, profile, var)

    def refresh_loads(self) -> None:
        ids = list(self.by_id)
        if not ids:
            return
        try:
            loads = self.store.loads(ids)
            self.health.succeeded()
        except REDIS_ERRORS as e:
            self.health.failed(e)
            return
        except (ValueError, TypeError) as e:
            log.error("cannot read loads: %s", e)
            return
        seen, wall = self.clock.monotonic(), self.clock.time()
        # The siblings' part of what this gateway held at the scrapes: the most each held lately.
        sib = self.shared.others(list(loads), seen, recent=True) if self.shared is not None else {}
        with self.lock:
            for i, rec in loads.items():
                old = self.loads.get(i)
                if old is None or old.ts != rec.ts:
                    # Remember our own in-flight count at this sample, so the router can tell the
                    # scrape's other-gateway traffic from ours (which it counts exactly); and when we
                    # first saw it, so freshness never compares the agent's clock with ours. The sample
                    # was taken some time in the last two refresh intervals, when we may have held more
                    # than now: the most we held then is subtracted, or our own requests that ended
                    # since would count as another gateway's and fill the endpoint with phantoms.
                    ours = self._held_at(i, rec.ts, wall) + sib.get(i, 0)
                    st = replace(self.stats.get(i, EndpointStats()), scrape_inflight=ours,
                                 load_seen=seen, slots=self._slots(old, rec, self.stats.get(i)))
                    self.stats[i] = st
                    self._learn_scrape(i, old, rec, seen)
            self.loads = loads
            self._others_ratio(loads)
            self._derive_speeds()
        self.on_release()

    def _others_ratio(self, loads: dict[str, LoadRecord]) -> None:
        """Per model, how many requests the other gateways had on its endpoints per one of ours at
        the last scrapes (routing.ahead_of extrapolates their growth since with it)."""
        held: dict[str, list[float]] = {}  # model -> [ours, others]
        for i, rec in loads.items():
            st, ep = self.stats.get(i), self.by_id.get(i)
            if st is None or ep is None or st.scrape_inflight is None or not rec.ok:
                continue
            acc = held.setdefault(ep.model or ep.models[0], [0.0, 0.0])
            acc[0] += st.scrape_inflight
            acc[1] += max(0.0, (rec.running or 0) + (rec.waiting or 0) - st.scrape_inflight)
        for i, st in self.stats.items():
            ep = self.by_id.get(i)
            acc = held.get(ep.model or ep.models[0]) if ep is not None else None
            ratio = acc[1] / acc[0] if acc and acc[0] > 0 else 0.0
            if ratio != st.others_ratio:
                self.stats[i] = replace(st, others_ratio=ratio)

    def _changed(self, eid: str, before: int, after: int) -> None:
        q = self.changes.get(eid)
        if q is None:
            q = self.changes[eid] = deque(maxlen=CHANGES_KEPT)
        q.append((self.clock.time(), before, after))
        if self.shared is not None:
            self.shared.publish(eid, before, after, self.clock.monotonic())

    def held(self, now: float, model: str | None = None) -> Mapping[str, int]:
        """What this gateway holds per endpoint (of `model`, or all): our own requests plus the
        sibling workers'."""
        if self.shared is None:
            return self.inflight
        both = dict(self.inflight)
        ids = [e.id for e in self.endpoints if model is None or model in e.models]
        for eid, n in self.shared.others(ids, now).items():
            both[eid] = both.get(eid, 0) + n
        return both

    def _held_at(self, eid: str, ts: float, wall: float) -> int:
        """What we held on the endpoint at wall-clock time `ts`. When the agent's clock does not
        agree with ours, or the changes kept do not reach back that far, the most we held in what
        is kept (so our own ended requests are never taken for another gateway's)."""
        now = self.inflight.get(eid, 0)
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

    @staticmethod
    def _slots(old: LoadRecord | None, rec: LoadRecord, st: EndpointStats | None) -> int | None:
        """The engine's batch limit: the running count while requests waited in it, in two scrapes in a
        row (a single scrape may catch a request between its arrival and the next engine step)."""
        prev = st.slots if st is not None else None
        if (old is not None and old.ok and rec.ok and (old.waiting or 0) > 0 and (rec.waiting or 0) > 0
                and old.running and rec.running):
            return max(prev or 0, int(min(old.running, rec.running)))
        return prev

    def _learn_scrape(self, i: str, old: LoadRecord | None, rec: LoadRecord, now: float) -> None:
        """Seconds per token per running sequence between two scrapes, at the mean running count."""
        if (old is None or not (old.ok and rec.ok) or old.generation_tokens_total is None
                or rec.generation_tokens_total is None):
            return
        dt = rec.ts - old.ts
        dgen = rec.generation_tokens_total - old.generation_tokens_total
        # Only an engine busy at both ends, with more than one sequence, was likely busy all along:
        # otherwise the mean running count says nothing about how long it worked for its tokens
        # (one request ending and the next arriving later looks like a slow engine).
        if dt <= 0 or dgen <= 0 or (old.running or 0) < 2 or (rec.running or 0) < 2:
            return
        running = (old.running + rec.running) / 2
        lr = self.learned.setdefault(i, Learned())
        lr.per_token = lr.per_token.add(running, running * dt / dgen, now, self.cfg.routing.learn_half_life)
        lr.last = now

    def _derive_speeds(self) -> None:
        """Every endpoint's Speed from its samples (the fleet's tokens per answer may have moved too),
        the endpoints of each model pulled together as far as their samples cannot tell them apart."""
        raw = {i: est for i, lr in self.learned.items() if (est := self._speed(lr)) is not None}
        groups: dict[str, list[str]] = {}
        for i in raw:
            ep = self.by_id.get(i)
            groups.setdefault(ep.model or ep.models[0] if ep is not None else i, []).append(i)
        for ids in groups.values():
            for i, speed in zip(ids, shrink([raw[i] for i in ids])):
                st, lr = self.stats.get(i, EndpointStats()), self.learned[i]
                if speed != st.speed or lr.last != st.last_sample:
                    self.stats[i] = replace(st, speed=speed, last_sample=lr.last)

    def _speed(self, lr: Learned) -> tuple[Speed, float] | None:
        """A typical answer's speed, and its relative error: per-token times x tokens per answer, and
        the answers' own decode times, averaged by how precise each is."""
        tokens = self.tokens_per_request or self.tokens_estimate
        lines = []  # (precision, decode1, slowdown)
        if tokens and (line := lr.per_token.line()) is not None:
            lines.append((max(lr.per_token.error(), 1e-3) ** -2, tokens * line[0], line[1]))
        if (line := lr.per_request.line()) is not None:
            lines.append((max(lr.per_request.error(), 1e-3) ** -2, line[0], line[1]))
        if not lines:
            return None
        w = sum(x[0] for x in lines)
        speed = Speed(sum(x[0] * x[1] for x in lines) / w, sum(x[0] * x[2] for x in lines) / w, lr.ttfb or 0.0)
        return speed, w ** -0.5

    def run_pollers(self) -> list[threading.Thread]:
        """Start the background threads (daemon): endpoint poller, pub/sub listener, load refresher."""
        threads = [
            threading.Thread(target=self._poll_loop, name="llmgw-endpoints", daemon=True),
            threading.Thread(target=self._pubsub_loop, name="llmgw-pubsub", daemon=True),
            threading.Thread(target=self._load_loop, name="llmgw-loads", daemon=True),
        ]
        for t in threads:
            t.start()
        return threads

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def _poll_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.refresh_endpoints()
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("endpoint refresh failed")
            self.wake.wait(self.cfg.poll_interval)
            self.wake.clear()

    def _load_loop(self) -> None:
        while not self.stopping.wait(self.cfg.load_interval):
            try:
                self.refresh_loads()
            except Exception:  # noqa: BLE001
                log.exception("load refresh failed")

    def _pubsub_loop(self) -> None:
        while not self.stopping.is_set():
            ps = None
            try:
                ps = self.store.subscribe_endpoints()
                while not self.stopping.is_set():
                    if ps.get_message(timeout=1.0):
                        self.wake.set()
            except REDIS_ERRORS:
                pass  # the poller reports the outage; just retry quietly
            except Exception:  # noqa: BLE001
                log.exception("pub/sub listener failed")
            finally:
                if ps is not None:
                    try:
                        ps.close()
                    except Exception:  # noqa: BLE001
                        pass
            self.stopping.wait(1.0)

    # --- request path ------------------------------------------------------------------------------
    def route(self, req: RouteRequest) -> Choice | Rejection:
        """Choose and reserve (in-flight + 1) atomically, so concurrent requests see each other."""
        now = self.clock.monotonic()
        with self.lock:
            res = choose(self.endpoints, self.loads, self.held(now, req.model), req, now, stats=self.stats,
                         cfg=self.cfg.routing, rng=self.rng, rr_counter=self.rr_counter)
            if isinstance(res, Choice):
                self.rr_counter += 1
                ep = res.endpoint
                n = self.inflight[ep.id] = self.inflight.get(ep.id, 0) + 1
                self._changed(ep.id, n - 1, n)
                m = ep.model or ep.models[0]
                self.model_inflight[m] = self.model_inflight.get(m, 0) + 1
        if isinstance(res, Choice) and self.metrics:
            self.metrics.child(self.metrics.inflight, res.endpoint.id).inc()
        return res

    def mark_unreachable(self, endpoint_id: str) -> None:
        """The endpoint refused a connection: pass it over for `eject_for` seconds (routing.choose)."""
        self.fail_at[endpoint_id] = self.clock.time()
        with self.lock:
            st = self.stats.get(endpoint_id, EndpointStats())
            self.stats[endpoint_id] = replace(st, down_until=self.clock.monotonic() + self.cfg.routing.eject_for)

    def timed_out(self, endpoint_id: str) -> None:
        """The endpoint accepted a request but sent nothing in time: evidence against it."""
        self.fail_at[endpoint_id] = self.clock.time()

    def answered(self, endpoint_id: str) -> None:
        """A response head arrived from the endpoint: evidence that it serves."""
        self.ok_at[endpoint_id] = self.clock.time()

    def requested(self, model: str) -> None:
        """A request for a known model arrived (demand, even when nothing can serve it yet)."""
        self.last_request_at[self.canonical.get(model, model)] = self.clock.time()

    def release(self, choice: Choice, service_time: float | None, tokens: int | None = None,
                ttfb: float | None = None) -> None:
        """The request left the endpoint. If it completed normally, learn from it once: its decode
        time (elapsed after the first byte) at the concurrency it ran in, its tokens per second when
        the answer reported usage, and the time to first byte when it found a free slot."""
        ep = choice.endpoint
        eid, m = ep.id, ep.model or ep.models[0]
        with self.lock:
            self.model_inflight[m] = max(0, self.model_inflight.get(m, 0) - 1)
            ours = self.inflight.get(eid, 0)
            self.inflight[eid] = max(0, ours - 1)
            self._changed(eid, ours, self.inflight[eid])
            if service_time is not None and service_time > 0:
                self._learn_answer(choice, ours, service_time, tokens, ttfb)
        if self.metrics:
            self.metrics.child(self.metrics.inflight, eid).dec()
        self.on_release()

    def names_of(self, model: str) -> frozenset[str]:
        """Every name of the model called `model` (just that name when it is unknown)."""
        return self.names.get(model) or frozenset((model,))
    def _learn_answer(self, choice: Choice, ours: int, elapsed: float, tokens: int | None,
                      ttfb: float | None) -> None:
        ep = choice.endpoint
        now = self.clock.monotonic()
        st = self.stats.get(ep.id)
        lr = self.learned.get(ep.id)
        if lr is None:
            lr = self.learned[ep.id] = Learned()
        slots = slots_of(ep, st)
        # The concurrency it ran in: what the endpoint held when it was sent and when it ended.
        load = fresh_load(self.loads.get(ep.id), now, self.cfg.routing, st.load_seen if st is not None else None)
        if self.shared is not None:  # what the whole gateway held, as choice.ahead counted it
            ours += self.shared.others((ep.id,), now).get(ep.id, 0)
        conc = min(slots, max(1.0, (choice.ahead + 1 + ahead_of(ep, load, ours, st)) / 2))
        decode = elapsed - ttfb if ttfb is not None and 0 <= ttfb < elapsed else elapsed
        half_life = self.cfg.routing.learn_half_life
        if tokens:
            t = self.tokens_per_request
            self.tokens_per_request = tokens if t is None else t + TOKENS_ALPHA * (tokens - t)
            lr.per_token = lr.per_token.add(conc, decode / max(1, tokens - 1), now, half_life)
        elif (line := lr.per_token.line()) is not None:
            implied = 1 + decode / (line[0] * (1 + line[1] * (conc - 1)))
            t = self.tokens_estimate
            self.tokens_estimate = implied if t is None else t + TOKENS_ALPHA * (implied - t)
        lr.per_request = lr.per_request.add(conc, decode, now, half_life)
        if ttfb is not None and choice.ahead + 1 <= slots:
            lr.ttfb = ttfb if lr.ttfb is None else lr.ttfb + EWMA_ALPHA * (ttfb - lr.ttfb)
        lr.last = now

    def completion_rate(self, model: str) -> float | None:
        """Requests per second the model's endpoints complete when full (None: not known yet)."""
        with self.lock:
            return fleet_rate(self.endpoints, self.stats, model)

    def models(self) -> dict[str, list[EndpointInfo]]:
        out: dict[str, list[EndpointInfo]] = {}
        for e in self.endpoints:
            for m in e.models:
                out.setdefault(m, []).append(e)
        return out

    def model_cards(self) -> list[dict]:
        """`GET /v1/models`: every name with a routable endpoint, OpenAI's fields and llmgw's: the
        model's other names, its endpoints' engines, how many are Ready, and the context length
        (the smallest any of them reports: a request must fit wherever it lands)."""
        cards = []
        for name, eps in sorted(self.models().items()):
            lengths = [rec.context_length for e in eps if (rec := self.loads.get(e.id)) and rec.context_length]
            cards.append({
                "id": name, "object": "model", "created": 0, "owned_by": "llmgw",
                "aliases": [n for n in eps[0].models if n != name],
                "engines": sorted({e.engine for e in eps}),
                "ready_replicas": len(eps),
                "context_length": min(lengths) if lengths else None,
            })
        return cards

    def report(self, who: Identity, queued: dict[str, int], keys_loaded: bool) -> GatewayReport:
        """This process's report now; `queued` by the requested name (aliases have their own queues)."""
        by_model: dict[str, int] = {}
        for name, n in queued.items():
            if n:
                m = self.canonical.get(name, name)
                by_model[m] = by_model.get(m, 0) + n
        with self.lock:  # consistent copies; the pure builder runs outside the lock
            snap = (self.version, dict(self.inflight), dict(self.ok_at), dict(self.fail_at),
                    dict(self.model_inflight), dict(self.last_request_at))
        version, inflight, ok_at, fail_at, model_inflight, last = snap
        return gateway_report(who, self.clock.time(), version, keys_loaded, inflight, ok_at, fail_at,
                              model_inflight, by_model, last)
