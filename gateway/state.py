"""The gateway's in-memory tables, refreshed in the background, never per request.

- endpoints: reloaded when `Store.endpoints_version()` changes (polled every ~0.5 s, woken early by
  the pub/sub hint);
- loads: one MGET of the endpoints' LoadRecords every ~0.5 s;
- in-flight counts and learned service times: updated by the request path itself;
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
import random
import threading
from collections import deque
from dataclasses import replace
from typing import Callable

import redis

from gateway.config import GatewaySettings
from gateway.report import Identity, gateway_report
from gateway.routing import Choice, EndpointStats, Rejection, RouteRequest, choose
from llmgw.catalog import catalog_names as read_catalog_names
from llmgw.state.clock import Clock
from llmgw.state.records import EndpointInfo, GatewayReport, LoadRecord
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

REDIS_ERRORS = (redis.exceptions.RedisError, OSError)
EWMA_ALPHA = 0.25
FULL_RELOAD_EVERY = 30.0  # seconds


def inflight_at(changes: deque[tuple[float, int]], at: float) -> int:
    """What this gateway had in flight on an endpoint at `at` (its monotonic clock), from the log of
    every change as (time, count after it), oldest first; 0 before the first change (the log keeps
    the change in force at its horizon). Pure."""
    count = 0
    for t, n in changes:
        if t > at:
            break
        count = n
    return count


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


class GatewayState:
    """Endpoint list, loads, in-flight counts and learned service times, behind one lock."""

    def __init__(self, store: Store, cfg: GatewaySettings, clock: Clock | None = None, metrics=None,
                 rng: random.Random | None = None):
        self.store = store
        self.cfg = cfg
        self.clock = clock or Clock()
        self.metrics = metrics
        self.rng = rng or random.Random(cfg.seed)
        self.lock = threading.Lock()
        self.health = RedisHealth(self.clock, self._redis_changed)
        self.version = 0
        self.fingerprint = ""
        self._last_full = float("-inf")
        self.endpoints: tuple[EndpointInfo, ...] = ()
        self.by_id: dict[str, EndpointInfo] = {}
        self.loads: dict[str, LoadRecord] = {}
        self.inflight: dict[str, int] = {}  # kept for endpoints that left the list while in flight
        # Per endpoint, the recent changes of `inflight` as (monotonic time, count after): what we had
        # in flight when the engine was scraped, to tell our requests in a scrape from the others'.
        self.changes: dict[str, deque[tuple[float, int]]] = {}
        self.ok_at: dict[str, float] = {}  # wall clock of the last response head per endpoint
        self.fail_at: dict[str, float] = {}  # ... of the last connection failure or first-byte timeout
        self.model_inflight: dict[str, int] = {}  # by canonical model name
        self.last_request_at: dict[str, float] = {}  # by canonical name (the requested one if unpublished)
        self.canonical: dict[str, str] = {}  # alias or name -> canonical model name, from the list
        self.stats: dict[str, EndpointStats] = {}
        # Names in the applied catalog or the published list: 503 (no Ready replica), not 404. A model
        # removed from the catalog becomes unknown again once its endpoints are unpublished.
        self.known_models: set[str] = set()
        self.loaded_once = False
        self.rr_counter = 0
        self.tokens_per_request: float | None = None  # completion tokens per answer, smoothed
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
            catalog_names = read_catalog_names(self.store)
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
                self.known_models = catalog_names | {n for e in self.endpoints for n in e.models}
            return False
        with self.lock:
            self.version, self.fingerprint, self.endpoints = v, fp, tuple(eps)
            self.by_id = {e.id: e for e in eps}
            self.known_models = catalog_names | {n for e in eps for n in e.models}
            self.loads = {k: v for k, v in self.loads.items() if k in self.by_id}
            self.stats = {k: v for k, v in self.stats.items() if k in self.by_id}
            # An endpoint that left the list stays while requests are in flight on it (the report
            # must show them: the control plane waits for them before stopping its replica).
            self.inflight = {k: n for k, n in self.inflight.items() if n > 0 or k in self.by_id}
            self.changes = {k: c for k, c in self.changes.items() if k in self.inflight}
            self.ok_at = {k: t for k, t in self.ok_at.items() if k in self.inflight}
            self.fail_at = {k: t for k, t in self.fail_at.items() if k in self.inflight}
            self.canonical = {n: e.model or e.models[0] for e in eps for n in e.models}
            self.loaded_once = True
        if self.metrics:
            self.metrics.endpoints_version.set(v)
            self.metrics.endpoints.set(len(eps))
        log.info("endpoint list version %d: %d endpoints", v, len(eps))
        self.on_loaded()
        self.on_release()
        return True

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
        with self.lock:
            for i, rec in loads.items():
                old = self.loads.get(i)
                if old is None or old.ts != rec.ts:
                    # Remember our own in-flight count when the engine was scraped (up to a scrape
                    # interval plus our refresh ago: the agent stamps the scrape, clocks are kept in
                    # sync, and the age is bounded either way), so the router can tell the scrape's
                    # other-gateway traffic from ours, which it counts exactly. Our count now would
                    # see phantom others whenever our requests turned over since the scrape. And when
                    # we first saw it, so freshness is judged on our clock alone.
                    age = min(max(0.0, wall - rec.ts), self.cfg.routing.stale_after)
                    ours = inflight_at(self.changes.get(i, deque()), seen - age)
                    st = self.stats.get(i, EndpointStats())
                    self.stats[i] = replace(st, scrape_inflight=ours, load_seen=seen,
                                            scrape_unit=self._scrape_unit(old, rec, st.scrape_unit))
            self.loads = loads
        self.on_release()

    def _scrape_unit(self, old: LoadRecord | None, rec: LoadRecord, prev: float | None) -> float | None:
        """Per-request service time implied by two scrapes: seconds per generated token per running
        sequence, times the tokens a request of this fleet generates (as the answers' usage says)."""
        if (old is None or not (old.ok and rec.ok) or self.tokens_per_request is None
                or old.generation_tokens_total is None or rec.generation_tokens_total is None):
            return prev
        dt = rec.ts - old.ts
        dgen = rec.generation_tokens_total - old.generation_tokens_total
        running = ((old.running or 0) + (rec.running or 0)) / 2
        if dt <= 0 or dgen <= 0 or running <= 0:
            return prev
        sample = self.tokens_per_request * dt * running / dgen
        return sample if prev is None else prev + EWMA_ALPHA * (sample - prev)

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
            res = choose(self.endpoints, self.loads, self.inflight, req, now, stats=self.stats,
                         cfg=self.cfg.routing, rng=self.rng, rr_counter=self.rr_counter)
            if isinstance(res, Choice):
                self.rr_counter += 1
                ep = res.endpoint
                self.inflight[ep.id] = self.inflight.get(ep.id, 0) + 1
                self._changed(ep.id, now)
                m = ep.model or ep.models[0]
                self.model_inflight[m] = self.model_inflight.get(m, 0) + 1
        if isinstance(res, Choice) and self.metrics:
            self.metrics.child(self.metrics.inflight, res.endpoint.id).inc()
        return res

    def _changed(self, endpoint_id: str, now: float) -> None:
        """Log the new in-flight count (under the lock); forget what no fresh scrape can predate."""
        changes = self.changes.get(endpoint_id)
        if changes is None:
            changes = self.changes[endpoint_id] = deque()
        changes.append((now, self.inflight[endpoint_id]))
        horizon = now - self.cfg.routing.stale_after
        while len(changes) > 1 and changes[1][0] <= horizon:  # keep the count in force at the horizon
            changes.popleft()

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

    def release(self, choice: Choice, service_time: float | None, tokens: int | None = None) -> None:
        """The request left the endpoint; learn its service time if it completed normally."""
        ep = choice.endpoint
        eid, m = ep.id, ep.model or ep.models[0]
        with self.lock:
            self.model_inflight[m] = max(0, self.model_inflight.get(m, 0) - 1)
            if tokens:
                t = self.tokens_per_request
                self.tokens_per_request = tokens if t is None else t + 0.05 * (tokens - t)
            self.inflight[eid] = max(0, self.inflight.get(eid, 0) - 1)
            self._changed(eid, self.clock.monotonic())
            if service_time is not None and service_time > 0:
                slots = max(1, choice.endpoint.capacity or 1)
                sample = service_time / max(1.0, (choice.ahead + 1) / slots)
                st = self.stats.get(eid, EndpointStats())
                unit = sample if st.unit is None else st.unit + EWMA_ALPHA * (sample - st.unit)
                self.stats[eid] = replace(st, unit=unit, last_sample=self.clock.monotonic())
        if self.metrics:
            self.metrics.child(self.metrics.inflight, eid).dec()
        self.on_release()

    def models(self) -> dict[str, list[EndpointInfo]]:
        out: dict[str, list[EndpointInfo]] = {}
        for e in self.endpoints:
            for m in e.models:
                out.setdefault(m, []).append(e)
        return out

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
