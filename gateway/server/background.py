"""The gateway process's slow loops, off the request path: the key table and the usage flush (with the
console's traffic counts and the saturation events), and the gateway report the control plane waits
for (docs/lifecycle.md). Each loop never dies: a failure is logged and the next pass retries.
"""

from __future__ import annotations

import logging
import threading

from gateway.config import GatewaySettings
from gateway.keys.table import KeyTable
from gateway.keys.usage import UsageRecorder
from gateway.observe.explain import ExplainLog
from gateway.observe.feeders import FeederLines
from gateway.observe.health import REDIS_ERRORS, RedisHealth
from gateway.observe.report import Identity, gateway_report, report_ttl
from gateway.observe.resumes import ResumeSignals
from gateway.observe.resumes import news as resume_news
from gateway.observe.saturation import Episode, SaturationSignals
from gateway.observe.saturation import step as saturation_step
from gateway.observe.traffic import KEEP as TRAFFIC_KEEP
from gateway.observe.traffic import TrafficCounter
from gateway.routing.exchange import Exchange
from gateway.routing.queue import WaitQueues
from llmgw.state.clock import Clock
from llmgw.state.demand_records import GatewayReport
from llmgw.state.served import SERVED_KEEP
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

# At most one model_saturated (model_recovered) event per model in this many seconds, fleet-wide.
SATURATION_EVENT_EVERY = 5.0
# While requests wait, how often a worker looks whether a sibling worker freed a slot: one read of
# the shared table per process (not per waiter), and none at all while nothing waits.
SIBLING_RECHECK = 0.01
EVICT_LOOK = 0.01  # seconds between looks at the eviction flags, while this worker runs answers
EVICT_REFRESH = 0.25  # seconds between refreshes of what the sibling workers read of its answers


class Background:
    def __init__(self, cfg: GatewaySettings, clock: Clock, store: Store, health: RedisHealth, keys: KeyTable,
                 usage: UsageRecorder, traffic: TrafficCounter, saturation: SaturationSignals, exchange: Exchange,
                 queues: WaitQueues, identity: Identity, resumes: ResumeSignals | None = None, siblings=None,
                 evictions=None, explained: ExplainLog | None = None, feeders: FeederLines | None = None):
        self.cfg, self.clock, self.store, self.health = cfg, clock, store, health
        self.keys, self.usage, self.traffic, self.saturation = keys, usage, traffic, saturation
        self.exchange, self.queues, self.identity = exchange, queues, identity
        self.siblings = siblings  # the sibling workers' table (gateway.server.siblings; None: alone)
        self.resumes = resumes if resumes is not None else ResumeSignals()
        self.evictions = evictions  # gateway.http.evictions.Evictions: the sibling workers' eviction flags
        self.explained = explained if explained is not None else ExplainLog()
        self.feeders = feeders if feeders is not None else FeederLines()  # the batch lines held, by feeder
        self.episodes: dict[str, Episode] = {}
        self.report_due = threading.Event()  # set: write the report now, not at the next tick
        self.stopping = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._slow_loop, name="llmgw-keys-usage", daemon=True).start()
        threading.Thread(target=self._report_loop, name="llmgw-report", daemon=True).start()
        if self.siblings is not None:
            threading.Thread(target=self._sibling_loop, name="llmgw-siblings", daemon=True).start()
            if self.evictions is not None and self.evictions.enabled:
                threading.Thread(target=self._evict_loop, name="llmgw-evictions", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()
        self.report_due.set()
        self.queues.waiting.set()
        if self.evictions is not None:
            self.evictions.listed.set()

    def _evict_loop(self) -> None:
        """While this worker has answers that may be evicted: every EVICT_LOOK seconds, pause the ones a
        sibling worker asked to evict (gateway.server.board), and every EVICT_REFRESH seconds show the
        siblings how far each got. Sleeps while it has none."""
        ev, looks = self.evictions, 0
        per_refresh = max(1, round(EVICT_REFRESH / EVICT_LOOK))
        while not self.stopping.is_set():
            try:
                if not ev.busy:
                    ev.listed.clear()
                    if not ev.busy:  # (an answer added before the clear set it first)
                        ev.listed.wait()
                        continue
                self.stopping.wait(EVICT_LOOK)
                ev.look()
                looks += 1
                if looks % per_refresh == 0:
                    ev.publish()
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("looking at the sibling workers' eviction flags failed")
                self.stopping.wait(1.0)

    def _sibling_loop(self) -> None:
        """A slot a sibling worker frees wakes this worker's queues (its own releases wake them
        directly, gateway.routing.router). Sleeps on `queues.waiting` while no request waits."""
        shared, queues = self.siblings, self.queues
        last = shared.releases()
        while not self.stopping.is_set():
            try:
                if not queues.busy():
                    queues.waiting.clear()
                    if not queues.busy():  # (a request that joined before the clear set it first)
                        queues.waiting.wait()
                        continue
                self.stopping.wait(SIBLING_RECHECK)
                n = shared.releases()
                if n != last:
                    last = n
                    queues.wake(None)
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("watching the sibling workers' releases failed")
                self.stopping.wait(1.0)

    def _slow_loop(self) -> None:
        last_keys = float("-inf")  # the table is read at once: readiness waits for it
        while not self.stopping.is_set():
            try:
                if self.clock.monotonic() - last_keys >= self.cfg.keys_interval or not self.keys.loaded:
                    last_keys = self.clock.monotonic()
                    self.keys.refresh()
                self.usage.flush(self.keys.budget_periods(self.clock.time()))
                self.flush_traffic()
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("key/usage refresh failed")
            self.stopping.wait(self.cfg.usage_flush)

    def flush_traffic(self) -> None:
        """Add this process's traffic counts to Redis (dropped on failure: they only feed charts) and
        the records of its explained requests, and put a saturation episode's start and end in the
        event history."""
        counts = self.traffic.take()
        if counts:
            try:
                self.store.add_traffic(counts, TRAFFIC_KEEP)
            except REDIS_ERRORS as e:
                self.health.failed(e)
        served = self.explained.take()  # the requests that asked to be explained (gateway.observe.explain)
        if served:
            try:
                self.store.add_served(served, SERVED_KEEP)
            except REDIS_ERRORS as e:  # dropped: this process still answers for its recent ones
                self.health.failed(e)
        self.episodes, news = saturation_step(self.episodes, self.saturation.take(), self.clock.time())
        for n in news:
            self.store.emit_limited(n.kind, n.message, subject=n.model, every=SATURATION_EVENT_EVERY,
                                    source=f"gateway:{self.identity.id}", model=n.model, queued=n.queued,
                                    shed=n.shed)
        for r in resume_news(self.resumes.take()):
            self.store.emit("stream_resumed", r.message, source=f"gateway:{self.identity.id}", model=r.model,
                            outcomes=r.counts, causes=r.causes)

    def _report_loop(self) -> None:
        """Write this process's GatewayReport every `report_interval`, and at once when a new endpoint
        list is in use (the acknowledgement the control plane waits for before stopping a replica)."""
        ttl = report_ttl(self.cfg.report_interval)
        while not self.stopping.is_set():
            self.report_due.wait(self.cfg.report_interval)
            self.report_due.clear()
            if self.stopping.is_set():
                return
            try:
                self.store.write_gateway_report(self.report(), ttl)
                self.health.succeeded()
            except REDIS_ERRORS as e:
                self.health.failed(e)  # logged once per outage; the next pass retries
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("gateway report failed")

    def report(self) -> GatewayReport:
        """This process's report now; queues are by the requested name (aliases have their own)."""
        canonical = self.exchange.tables().canonical
        queued: dict[str, int] = {}
        for name, n in self.queues.lengths().items():
            if n:
                m = canonical.get(name, name)
                queued[m] = queued.get(m, 0) + n
        feeders, f = self.feeders.read(self.exchange.report_facts)  # at one instant (gateway.observe.feeders)
        return gateway_report(self.identity, self.clock.time(), f.version, self.keys.loaded, f.inflight, f.ok_at,
                              f.fail_at, f.by_model, queued, f.last_request_at, self.exchange.prefix_facts(), feeders)
