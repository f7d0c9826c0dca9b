"""The gateway's composition root: `create_app` builds one process's `Gateway` (its parts, wired) and
its WSGI app. `gunicorn -c python:gateway.gunicorn_conf 'gateway:create_app()'`.

The request path (gateway.http.proxy) reads only in-memory tables: the routing snapshot
(gateway.routing), kept fresh from Redis by background loops (gateway.server.pollers), and the key
table (gateway.keys); only rate-limited keys cost one Redis round trip per request.

gunicorn's gevent worker serves it (gateway/gunicorn_conf.py): one greenlet per connection, so an open
stream costs a few kilobytes, not a thread. Its `post_worker_init` hook (gateway.server.boot) calls
`serve()`, which starts the loops and waits for the endpoint list and the key table before the first
request is accepted.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import socket
import threading
from typing import Mapping

from flask import Flask

from gateway.config import DEFAULT_MAX_CONNECTIONS, GatewaySettings
from gateway.http.answer import Answers, OpenRequests
from gateway.http.admit import Admission
from gateway.http.attempt import Sender
from gateway.http.evictions import Evictions
from gateway.http.resume import Pause
from gateway.http.proxy import Proxy
from gateway.routing import eviction
from gateway.http.refusal import unready
from gateway.http.views import flask_app
from gateway.http.wsgi import fast_path
from gateway.keys.gate import KeyGate
from gateway.keys.limits import RateLimiter
from gateway.keys.table import KeyTable
from gateway.keys.usage import UsageRecorder
from gateway.observe.demand import DemandSignal
from gateway.observe.explain import ExplainLog, Explaining, explained_wsgi
from gateway.observe.feeders import FeederLines
from gateway.observe.health import RedisHealth
from gateway.observe.metrics import Metrics
from gateway.observe.report import Identity
from gateway.observe.resumes import ResumeSignals
from gateway.observe.saturation import SaturationSignals
from gateway.observe.traffic import TrafficCounter
from gateway.routing.exchange import Exchange
from gateway.routing.inflight import InFlight
from gateway.routing.kvindex import SharedIndex
from gateway.routing.ledger import Ledger
from gateway.routing.queue import WaitQueues
from gateway.routing.remote_eviction import Asks
from gateway.routing.router import Router
from gateway.server.background import Background
from gateway.server.kvevents import KvSubscriber
from gateway.server.fairshare import FairShare
from gateway.server.pollers import Pollers
from gateway.server.tokenizers import Tokenizers
from gateway.server.remote_evictions import RemoteEvictions
from gateway.server.sendshare import SendShare
from gateway.server.siblings import SharedCounts, handed
from gateway.upstream.client import Upstream
from llmgw.state.clock import Clock
from llmgw.state.kicks import Kicker, broker_app, celery_sender
from llmgw.state.store import Store, connect
from llmgw.tracing import configure

log = logging.getLogger("llmgw.gateway")


class Gateway:
    """One gateway process: its parts, wired to each other, and their lifecycle."""

    def __init__(self, cfg: GatewaySettings, store: Store | None = None, clock: Clock | None = None,
                 request_store: Store | None = None, environ: Mapping[str, str] | None = None,
                 siblings: SharedCounts | None = None, tracing=None):
        self.cfg = cfg
        # Once per process, in the process that serves: gunicorn loads the app in each worker after
        # the fork, so each worker has its own provider and export thread (docs/tracing.md).
        self.tracing = tracing if tracing is not None else configure("llmgw-gateway")
        self.clock = clock = clock or Clock()
        self.metrics = metrics = Metrics()
        self.store = store or Store(connect(cfg.redis_url))
        # The request path gets its own client with short timeouts: a hung Redis must not hang requests.
        self.rstore = request_store or (
            self.store if store is not None
            else Store(connect(cfg.redis_url, socket_timeout=cfg.redis_timeout, socket_connect_timeout=cfg.redis_timeout))
        )
        self.health = RedisHealth(clock, lambda ok: metrics.redis_unavailable.set(0 if ok else 1))
        # The keys' service counters fair queueing orders the queues by (gateway.routing.fairness).
        self.ledger = Ledger(cfg.fair_output_weight, cfg.fairness == "fcfs", clock.monotonic)
        # The sibling workers' queue heads and running answers (gateway.server.board; None: this process
        # serves alone): one order across the workers, and evictions of each other's answers.
        board = siblings.board if siblings is not None else None
        self.queues = WaitQueues(cfg.queue_max, clock.monotonic, model_of=self._model_of, ledger=self.ledger,
                                 order=board, urgent=cfg.slo_urgent)
        # Precise prefix routing: the engines' KV events and the tokenizers to match prompts with.
        self.tokenizers = Tokenizers(environ if environ is not None else os.environ)
        self.kv = SharedIndex()
        # The in-flight counts, with the sibling workers' (gunicorn hands this worker its row as it makes
        # the app: gateway.server.worker), and what is sent kept for the other gateways when shared.
        counts = InFlight(siblings, outbox=cfg.share_sends > 0)
        # A slot freed or new tables wake the waiting requests; a new endpoint list is reported at once.
        self.router = Router(cfg.routing, clock, random.Random(cfg.seed), counts, self.kv, self.tokenizers.tokenize,
                             metrics, on_release=self.queues.wake)
        self.exchange = Exchange(counts, lambda: self.router.tables, clock, says_holds=cfg.routing.policy == "llmgw")
        self.pollers = Pollers(self.store, cfg, self.router, self.health, environ, on_loaded=self._list_loaded,
                               metrics=metrics)
        self.kv_events = KvSubscriber(self.kv, lambda: self.router.endpoints, self.tokenizers, metrics.kv_index)
        self.keys = KeyTable(self.store, self.health, cfg.auth)
        self.usage = UsageRecorder(self.store, self.health, clock)
        self.gate = KeyGate(self.keys, self.usage, RateLimiter(self.rstore, self.health, clock), clock, metrics,
                            cfg.default_priority, lambda model: self.router.tables.names_of(model), self.not_ready)
        self.upstream = Upstream(cfg.connect_timeout, cfg.first_byte_timeout, cfg.upstream_pool)
        # gateway.server.boot fits the cap to the process's file descriptors.
        self.open_requests = OpenRequests(cfg.max_connections or DEFAULT_MAX_CONNECTIONS)
        host = socket.gethostname()
        self.identity = Identity(f"{host}:{os.getpid()}", host, os.getpid(), clock.time())
        # The console's charts and the saturation events (gateway.observe.traffic, .saturation).
        self.traffic = TrafficCounter(clock.time)
        saturation = SaturationSignals()
        resumes = ResumeSignals()  # answers whose engine broke off (gateway.observe.resumes)
        self.demand = DemandSignal(
            self.store, lambda: Kicker(self.store, celery_sender(broker_app(cfg.redis_url)), enabled=cfg.event_driven),
            clock.time, clock.monotonic)
        # Running answers a request that ranks first may evict (gateway.routing.eviction).
        # (this gateway's name, the gunicorn master's host:pid, which its workers share)
        origin = siblings.origin if siblings is not None else self.identity.id
        asks = Asks(f"{origin}/{os.getpid()}", origin) if cfg.evict and cfg.evict_remote > 0 else None
        self.evictions = Evictions(
            eviction.Settings(cfg.evict, cfg.evict_margin, cfg.evict_min_run, cfg.evict_max, cfg.evict_slack), clock,
            self.ledger,
            self.queues.model_of, metrics, board, asks)
        # How the requests that ask (X-LLMGW-Explain) were served: `llmgw explain REQUEST_ID`, the playground.
        self.explained = ExplainLog()
        # The batch lines held, by the feeder that sent them: the report's `feeders` (gateway.observe.feeders).
        feeders = FeederLines()
        self.background = Background(cfg, clock, self.store, self.health, self.keys, self.usage, self.traffic,
                                     saturation, self.exchange, self.queues, self.identity, resumes, siblings,
                                     self.evictions, self.explained, feeders)
        answers = Answers(clock, metrics, self.traffic, self.usage, cfg.total_timeout, self.open_requests,
                          cfg.stall_timeout, resumes, self.evictions,
                          Pause(cfg.pause_keepalive, clock.monotonic, metrics))
        explaining = Explaining(self.tracing, self.explained, clock.time, clock.monotonic,
                                lambda eid: self.router.tables.by_id.get(eid),
                                lambda key: (k.name, k.id) if (k := self.keys.lookup(key)) is not None else ("", ""))
        admission = Admission(cfg, clock, self.router, self.queues, metrics, saturation, self.demand, self.evictions)
        sender = Sender(cfg, clock, self.router, self.upstream, admission, self.queues, metrics, feeders)
        self.proxy = Proxy(cfg, clock, self.router, self.gate, sender, answers, metrics, self.traffic, saturation,
                           self.not_ready, tracing=explaining)
        # What this gateway sent and holds, exchanged with the other gateways under its name (the
        # gunicorn master's host:pid, which its workers share).
        self.send_share = SendShare(self.store, self.exchange, clock, cfg.share_sends, origin, metrics)
        # A request that finds only other gateways' answers to evict asks them (gateway.server.remote_evictions).
        self.remote_evictions = (RemoteEvictions(self.store, asks, self.evictions, clock, cfg.evict_remote,
                                                 lambda: self.send_share.peers, self.queues.wake, self.router.lend)
                                 if asks is not None else None)
        self.fair_share = FairShare(self.store, self.queues, clock, cfg.share_fairness, metrics,
                                    lambda kid: (k.name if (k := self.keys.find(kid)) is not None else kid))
        self.stopping = threading.Event()
        self.started = False

    def _model_of(self, name: str) -> str:
        """The model a requested name is served by (an adapter's: its base model's)."""
        tables = self.router.tables
        adapter = tables.adapters.get(name) if tables.adapters else None
        return adapter.model if adapter is not None else tables.canonical.get(name, name)

    @property
    def open(self) -> int:
        return self.open_requests.n

    @property
    def max_open(self) -> int:
        return self.open_requests.cap

    @max_open.setter
    def max_open(self, cap: int) -> None:
        self.open_requests.cap = cap

    def _list_loaded(self) -> None:
        """A new endpoint list is in use: acknowledge it at once (the gateway report), and close the
        pooled connections to engines that left it."""
        self.background.report_due.set()
        self.upstream.retain([e.url for e in self.router.endpoints])

    def refresh(self) -> None:
        """One synchronous pass of every background refresh (tests)."""
        self.pollers.refresh_endpoints()
        self.pollers.refresh_loads()
        self.keys.refresh()

    def start(self) -> None:
        """Start the background loops in the process that serves (never in a gunicorn master: they
        would not survive the fork). Each loads its table at once; `serve` waits for them."""
        self.started = True
        self.pollers.start()
        self.background.start()
        self.kv_events.start()
        self.send_share.start()
        self.fair_share.start()
        if self.remote_evictions is not None:
            self.remote_evictions.start()
        atexit.register(self.usage.flush)  # a graceful worker exit writes the last usage

    def serve(self, wait: float, tick=lambda: None) -> bool:
        """Start, then wait up to `wait` seconds until this process can serve (`not_ready` is None),
        calling `tick` meanwhile (gunicorn's liveness notify). True when ready; when Redis stays down
        the process serves anyway, answering 503s that say why."""
        self.start()
        deadline = self.clock.monotonic() + wait
        while self.not_ready() is not None:
            if self.clock.monotonic() >= deadline:
                log.warning("serving without being ready after %gs: %s", wait, self.not_ready())
                return False
            tick()
            self.stopping.wait(0.02)
        return True

    def not_ready(self) -> str | None:
        """Why this process cannot serve yet (None: it can). /readyz and the 503s give this reason."""
        h = self.health
        return unready(self.keys.ready, self.router.tables.loaded, None if h.ok else h.last_error, self.started)

    def stop(self) -> None:
        self.stopping.set()
        self.pollers.stop()
        self.background.stop()
        self.kv_events.stop()
        self.send_share.stop()
        self.fair_share.stop()
        if self.remote_evictions is not None:
            self.remote_evictions.stop()
        self.usage.flush()


def create_app(config: GatewaySettings | None = None, *, store: Store | None = None, clock: Clock | None = None,
               environ: Mapping[str, str] | None = None, siblings: SharedCounts | None = None,
               tracing=None) -> Flask:
    """Build the app. With no arguments (gunicorn) the config comes from the environment; tests pass a
    Store on fakeredis, and a sibling table to route as one of several workers (under gunicorn, the
    worker's row handed to it while it makes the app: gateway.server.siblings.handing). Nothing runs in the
    background until `Gateway.serve` (gunicorn's post_worker_init, in the worker) or `Gateway.start`.
    `tracing`: a `llmgw.tracing.Tracing` (tests: over an in-memory exporter); None configures the
    process's from the OpenTelemetry environment."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gw = Gateway(config or GatewaySettings.from_env(), store=store, clock=clock, environ=environ,
                 siblings=siblings if siblings is not None else handed(), tracing=tracing)
    app = flask_app(gw)
    app.wsgi_app = explained_wsgi(fast_path(gw.proxy, gw.open_requests, gw.metrics, app.wsgi_app))
    return app
