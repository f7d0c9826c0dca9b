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
import socket
import threading
from typing import Mapping

from flask import Flask

from gateway.config import DEFAULT_MAX_CONNECTIONS, GatewaySettings
from gateway.http.answer import Answers, OpenRequests
from gateway.http.proxy import Proxy
from gateway.http.refusal import unready
from gateway.http.views import flask_app
from gateway.http.wsgi import fast_path
from gateway.keys.gate import KeyGate
from gateway.keys.limits import RateLimiter
from gateway.keys.table import KeyTable
from gateway.keys.usage import UsageRecorder
from gateway.observe.demand import DemandSignal
from gateway.observe.health import RedisHealth
from gateway.observe.metrics import Metrics
from gateway.observe.report import Identity
from gateway.observe.resumes import ResumeSignals
from gateway.observe.saturation import SaturationSignals
from gateway.observe.traffic import TrafficCounter
from gateway.routing.ledger import Ledger
from gateway.routing.queue import WaitQueues
from gateway.server.background import Background
from gateway.server.kvevents import KvSubscriber
from gateway.server.fairshare import FairShare
from gateway.server.pollers import PolledRouter
from gateway.server.tokenizers import Tokenizers
from gateway.server.sendshare import SendShare
from gateway.server.siblings import SharedCounts
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
        self.queues = WaitQueues(cfg.queue_max, clock.monotonic, model_of=self._model_of, ledger=self.ledger)
        # Precise prefix routing: the engines' KV events and the tokenizers to match prompts with.
        self.tokenizers = Tokenizers(environ if environ is not None else os.environ)
        # A slot freed or new tables wake the waiting requests; a new endpoint list is reported at once.
        self.router = PolledRouter(self.store, cfg, clock, metrics, environ=environ, shared=siblings, health=self.health,
                                   on_release=self.queues.wake, on_loaded=self._list_loaded,
                                   tokenize=self.tokenizers.tokenize)
        self.kv_events = KvSubscriber(self.router.kv, lambda: self.router.endpoints, self.tokenizers, metrics.kv_index)
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
        self.background = Background(cfg, clock, self.store, self.health, self.keys, self.usage, self.traffic,
                                     saturation, self.router, self.queues, self.identity, resumes)
        answers = Answers(clock, metrics, self.traffic, self.usage, cfg.total_timeout, self.open_requests,
                          cfg.stall_timeout, resumes)
        self.proxy = Proxy(cfg, clock, self.router, self.gate, self.upstream, self.queues, answers, metrics,
                           self.traffic, saturation, self.demand, self.not_ready, tracing=self.tracing)
        self.send_share: SendShare | None = None  # made by `start`
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

    def share_counts(self, table: SharedCounts | None) -> None:
        """Count with the sibling workers (gunicorn hands a worker its row after making the app)."""
        self.router.share(table)

    def _list_loaded(self) -> None:
        """A new endpoint list is in use: acknowledge it at once (the gateway report), and close the
        pooled connections to engines that left it."""
        self.background.report_due.set()
        self.upstream.retain([e.url for e in self.router.endpoints])

    def refresh(self) -> None:
        """One synchronous pass of every background refresh (tests)."""
        self.router.refresh_endpoints()
        self.router.refresh_loads()
        self.keys.refresh()

    def start(self) -> None:
        """Start the background loops in the process that serves (never in a gunicorn master: they
        would not survive the fork). Each loads its table at once; `serve` waits for them."""
        self.started = True
        self.router.run_pollers()
        self.background.start()
        self.kv_events.start()
        shared = self.router.siblings  # (set by share_counts, after the app was made)
        self.send_share = SendShare(self.store, self.router, self.clock, self.cfg.share_sends,
                                    shared.origin if shared is not None else self.identity.id, self.metrics)
        self.send_share.start()
        self.fair_share.start()
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
        self.router.stop()
        self.background.stop()
        self.kv_events.stop()
        if self.send_share is not None:
            self.send_share.stop()
        self.fair_share.stop()
        self.usage.flush()


def create_app(config: GatewaySettings | None = None, *, store: Store | None = None, clock: Clock | None = None,
               environ: Mapping[str, str] | None = None, siblings: SharedCounts | None = None,
               tracing=None) -> Flask:
    """Build the app. With no arguments (gunicorn) the config comes from the environment; tests pass a
    Store on fakeredis, and a sibling table to route as one of several workers. Nothing runs in the
    background until `Gateway.serve` (gunicorn's post_worker_init, in the worker) or `Gateway.start`.
    `tracing`: a `llmgw.tracing.Tracing` (tests: over an in-memory exporter); None configures the
    process's from the OpenTelemetry environment."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gw = Gateway(config or GatewaySettings.from_env(), store=store, clock=clock, environ=environ, siblings=siblings,
                 tracing=tracing)
    app = flask_app(gw)
    app.wsgi_app = fast_path(gw.proxy, gw.open_requests, gw.metrics, app.wsgi_app)
    return app
