"""The gateway app factory and its thin views: `gunicorn -c python:gateway.gunicorn_conf 'gateway:create_app()'`.

The request path is: read the body (size-capped), parse just enough JSON for `model`/`stream`/`user`,
check the key against the in-memory table, pick an endpoint from in-memory tables (gateway.routing),
forward over a pooled connection and stream back. Everything that needs Redis for routing happens in
background loops (gateway.state); only rate-limited keys cost one Redis round trip per request.

gunicorn's gevent worker serves it (gateway.gunicorn_conf): one greenlet per connection, so an open
stream costs a few kilobytes, not a thread. The worker's `post_worker_init` hook calls `serve()`,
which starts the loops and waits for the endpoint list and the key table before the first request
is accepted.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import uuid
from dataclasses import replace

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException
from werkzeug.http import HTTP_STATUS_CODES

from gateway.admission import Send, Shed, Wait, WaitQueue, admit
from gateway.auth import ApiKey, KeyTable, RateLimiter, UsageRecorder
from gateway.config import DEFAULT_MAX_CONNECTIONS, GatewaySettings
from gateway.errors import ApiError, error_response
from gateway.metrics import Metrics
from gateway.proxy import (
    FORWARD_REQUEST_HEADERS,
    STREAM_REPLACED,
    StreamBody,
    Upstream,
    UpstreamConnectError,
    UpstreamTimeout,
    response_headers,
    usage_from_json,
)
from gateway.report import Identity, report_ttl
from gateway.retry import Deliver, GiveUp, Outcome, next_attempt
from gateway.routing import Choice, Rejection, RouteRequest
from gateway.state import REDIS_ERRORS, GatewayState
from llmgw.state.apikeys import ANONYMOUS, PRIORITIES, cap_priority
from llmgw.state.clock import Clock
from llmgw.state.store import Store, connect

log = logging.getLogger("llmgw.gateway")

PROXIED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
SSE_HEADERS = [("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")]
HTTP_KIND = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


class RawAnswer:
    """A proxied answer as a bare WSGI app: status, headers and body iterable as they are (werkzeug's
    Response cost ~0.05 ms per request here and added nothing). A stream's body is the StreamBody,
    whose `close()` the server calls."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list[tuple[str, str]], body):
        self.status, self.headers, self.body = status, headers, body

    def __call__(self, environ, start_response):
        try:
            start_response(f"{self.status} {HTTP_STATUS_CODES.get(self.status, 'UNKNOWN')}", self.headers)
        except BaseException:
            # The server refused the head (an engine's malformed header, say): it will never close the
            # body, so give back what the body holds (the upstream connection, the slot) here.
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
            raise
        return self.body


class Lease:
    """One reserved in-flight slot on an endpoint; `release` gives it back once, however often called
    (the request path's `finally` and the answer's completion may both reach it)."""

    __slots__ = ("state", "choice", "done")

    def __init__(self, state: GatewayState, choice: Choice):
        self.state, self.choice, self.done = state, choice, False

    def release(self, service_time: float | None = None, tokens: int | None = None) -> None:
        if not self.done:
            self.done = True
            self.state.release(self.choice, service_time, tokens)


class Gateway:
    """Everything one gateway process holds: config, tables, clients, metrics, queues."""

    def __init__(self, cfg: GatewaySettings, store: Store | None = None, clock: Clock | None = None,
                 request_store: Store | None = None):
        self.cfg = cfg
        self.clock = clock or Clock()
        self.metrics = Metrics()
        self.store = store or Store(connect(cfg.redis_url))
        # The request path gets its own client with short timeouts: a hung Redis must not hang requests.
        self.rstore = request_store or (
            self.store if store is not None
            else Store(connect(cfg.redis_url, socket_timeout=cfg.redis_timeout, socket_connect_timeout=cfg.redis_timeout))
        )
        self.state = GatewayState(self.store, cfg, self.clock, self.metrics)
        self.keys = KeyTable(self.store, self.state.health, cfg.auth)
        self.limiter = RateLimiter(self.rstore, self.state.health, self.clock)
        self.usage = UsageRecorder(self.store, self.state.health, self.clock)
        self.upstream = Upstream(cfg.connect_timeout, cfg.first_byte_timeout, cfg.upstream_pool)
        self.queues: dict[str, WaitQueue] = {}
        self.queues_lock = threading.Lock()
        self.state.on_release = self._wake_queues
        self.stopping = threading.Event()
        self.started = False
        # Requests being proxied (parsed, queued, or streaming) in this process, and the most it takes
        # before answering 503: each holds a client connection, and once routed an upstream one. The
        # gevent worker switches greenlets only on I/O, so the plain += / -= on it are atomic.
        self.open = 0
        self.max_open = cfg.max_connections or DEFAULT_MAX_CONNECTIONS  # gateway.worker fits it to the fds
        host = socket.gethostname()
        self.identity = Identity(f"{host}:{os.getpid()}", host, os.getpid(), self.clock.time())
        self.report_due = threading.Event()
        self.state.on_loaded = self._list_loaded

    # --- background ----------------------------------------------------------------------------
    def _list_loaded(self) -> None:
        """A new endpoint list is in use: acknowledge it at once (the gateway report), and close the
        pooled connections to engines that left it."""
        self.report_due.set()
        self.upstream.retain([e.url for e in self.state.endpoints])

    def refresh(self) -> None:
        """One synchronous pass of every background refresh (tests)."""
        self.state.refresh_endpoints()
        self.state.refresh_loads()
        self.keys.refresh()

    def start(self) -> None:
        """Start the background loops in the process that serves (never in a gunicorn master: they
        would not survive the fork). Each loads its table at once; `wait_ready` waits for them."""
        self.started = True
        self.state.run_pollers()
        threading.Thread(target=self._slow_loop, name="llmgw-keys-usage", daemon=True).start()
        threading.Thread(target=self._report_loop, name="llmgw-report", daemon=True).start()
        atexit.register(self.usage.flush)  # a graceful worker exit writes the last usage

    def serve(self, wait: float, tick=lambda: None) -> bool:
        """Start, then wait up to `wait` seconds until this process can serve (`ready`), calling
        `tick` meanwhile (gunicorn's liveness notify). True when ready; when Redis stays down the
        process serves anyway, answering 503s that say why (`not_ready`)."""
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
        h = self.state.health
        why = (f" (Redis unavailable: {h.last_error})" if not h.ok
               else "" if self.started else " (this process never started its background loops: serve "
               "it with `gunicorn -c python:gateway.gunicorn_conf`)")
        if not self.keys.ready:
            return f"the gateway has not loaded its API keys yet{why}; retry shortly"
        if not self.state.loaded_once:
            return f"the gateway has not loaded the endpoint list yet{why}"
        return None

    def stop(self) -> None:
        self.stopping.set()
        self.state.stop()
        self.report_due.set()
        self.usage.flush()

    def _slow_loop(self) -> None:
        last_keys = float("-inf")  # the table is read at once: readiness waits for it
        while not self.stopping.is_set():
            try:
                if self.clock.monotonic() - last_keys >= self.cfg.keys_interval or not self.keys.loaded:
                    last_keys = self.clock.monotonic()
                    self.keys.refresh()
                self.usage.flush()
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("key/usage refresh failed")
            self.stopping.wait(self.cfg.usage_flush)

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
                self.state.health.succeeded()
            except REDIS_ERRORS as e:
                self.state.health.failed(e)  # logged once per outage; the next pass retries
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("gateway report failed")

    def report(self):
        queued = {name: len(q) for name, q in list(self.queues.items())}
        return self.state.report(self.identity, queued, self.keys.loaded)

    def queue(self, model: str) -> WaitQueue:
        """The model's wait queue; only ever called for names in `state.known_models`."""
        q = self.queues.get(model)
        if q is None:
            with self.queues_lock:
                q = self.queues.setdefault(model, WaitQueue(self.cfg.queue_max, monotonic=self.clock.monotonic))
        return q

    def _wake_queues(self) -> None:
        for q in list(self.queues.values()):
            q.notify()

    # --- the proxied request ---------------------------------------------------------------------
    def authenticate(self, environ: dict) -> ApiKey | None:
        keys_ = self.keys
        if keys_.mode == "off":
            return None
        if not keys_.loaded:
            raise ApiError("auth_unavailable", self.not_ready() or "the gateway has not loaded its API keys yet", 1)
        if not keys_.required:
            return None
        auth = environ.get("HTTP_AUTHORIZATION", "")
        presented = auth[7:].strip() if auth[:7].lower() == "bearer " else environ.get("HTTP_API_KEY")
        if not presented:
            raise ApiError("unauthorized", "missing API key: send 'Authorization: Bearer <key>'")
        key = self.keys.lookup(presented)
        if key is None:
            raise ApiError("unauthorized", "invalid API key")
        return key

    def read_body(self, environ: dict) -> bytes:
        limit = self.cfg.max_body_bytes
        try:
            length = int(environ.get("CONTENT_LENGTH") or -1)
        except ValueError:
            raise ApiError("bad_request", "invalid Content-Length") from None
        if length > limit:
            raise ApiError("too_large", f"request body is {length} bytes; the limit is {limit}")
        stream = environ["wsgi.input"]
        data = stream.read(length) if length >= 0 else stream.read(limit + 1)
        if len(data) > limit:
            raise ApiError("too_large", f"request body is over the limit of {limit} bytes")
        return data

    def proxy(self, path: str, environ: dict, rid: str) -> RawAnswer:
        """The proxied POST, on the raw WSGI environ (Flask's request machinery is skipped: it cost
        ~0.3 ms per request, as much as the rest of the gateway's work)."""
        mono = self.clock.monotonic
        t0 = mono()
        data = self.read_body(environ)
        try:
            body = json.loads(data)
        except ValueError as e:
            raise ApiError("bad_request", f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError("bad_request", "request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError("missing_model", "'model' is required and must be a non-empty string")
        key = self.authenticate(environ)
        prio = self.priority(environ.get("HTTP_X_LLMGW_PRIORITY") or None, key)
        if not self.state.loaded_once:
            raise ApiError("no_replica", self.not_ready() or "the gateway has not loaded the endpoint list yet", 1)
        if model not in self.state.known_models:
            # Unknown names get no per-name state and no metric label of their own (cardinality).
            self.metrics.rejected_unknown.inc()
            raise ApiError("model_not_found", f"model {model!r} does not exist")
        self.state.requested(model)
        if key is not None:
            limited = self.limiter.check(key)
            if limited:
                self.metrics.shed.labels(model, "rate_limited").inc()
                raise ApiError("rate_limited", f"rate limit of {limited[0]} reached for key {key.name!r}", limited[1])
        user = body.get("user")
        affinity = environ.get("HTTP_X_SESSION_ID") or (user if isinstance(user, str) and user else None)

        headers = {h: v for h, var in FORWARD_REQUEST_HEADERS if (v := environ.get(var))}
        headers["x-request-id"] = rid
        headers.setdefault("content-type", "application/json")
        exclude: set[str] = set()
        last_error: ApiError | None = None
        attempt = 0
        while True:
            req = RouteRequest(model, prio, affinity, frozenset(exclude))
            choice = self._admit(req, first=(attempt == 0), last_error=last_error)
            # From here the slot is ours: every path out of this block gives it back exactly once.
            lease = Lease(self.state, choice)
            resp = None
            try:
                ep = choice.endpoint
                out = data
                served = ep.served_name or ep.model or model
                if served != model:
                    out = json.dumps({**body, "model": served}).encode()
                t_send = mono()
                try:
                    resp = self.upstream.send(ep.url, path, out, headers)
                    self.state.answered(ep.id)
                    outcome = Outcome("answer", resp.status)
                except UpstreamConnectError as e:
                    log.warning("request %s: cannot reach %s (%s): %s", rid, ep.id, ep.url, e)
                    self.state.mark_unreachable(ep.id)
                    outcome = Outcome("connect_error")
                except UpstreamTimeout:
                    self.state.timed_out(ep.id)
                    outcome = Outcome("timeout")
                step = next_attempt(outcome, attempt, self.cfg.retries)
                if isinstance(step, Deliver):
                    answer = self._respond(resp, lease, model, key, rid, t0, t_send)
                    lease, resp = None, None  # handed over: the answer releases them when it ends
                    return answer
                if isinstance(step, GiveUp):
                    if step.kind == "upstream_timeout":
                        self.metrics.upstream_errors.labels(ep.id, "timeout").inc()
                        self.metrics.requests.labels(model, ep.id, "504").inc()
                        raise ApiError("upstream_timeout", f"endpoint {ep.id} sent nothing within "
                                       f"{self.cfg.first_byte_timeout}s")
                    self.metrics.upstream_errors.labels(ep.id, "connect").inc()
                    raise ApiError("no_replica", f"no endpoint of model {model!r} could be reached")
                self.metrics.upstream_errors.labels(ep.id, step.reason).inc()
                self.metrics.retries.labels(model).inc()
                exclude.add(ep.id)
                last_error = (ApiError("no_replica", f"no endpoint of model {model!r} could be reached")
                              if outcome.kind == "connect_error"
                              else ApiError("upstream_error", f"endpoint {ep.id} answered {outcome.status}"))
            finally:
                if resp is not None:
                    resp.close()
                if lease is not None:
                    lease.release()
            attempt += 1

    def priority(self, header: str | None, key: ApiKey | None) -> str:
        """The request's criticality: the header, capped at the key's (a key's own priority, else the
        default, is the highest its requests may claim); without a key the header stands."""
        if header is not None and header not in PRIORITIES:
            raise ApiError("bad_request", f"X-LLMGW-Priority must be one of {', '.join(PRIORITIES)}, got {header!r}")
        if key is None:
            return header or self.cfg.default_priority
        ceiling = key.priority or self.cfg.default_priority
        return cap_priority(header, ceiling) if header else ceiling

    def _admit(self, req: RouteRequest, first: bool, last_error: ApiError | None) -> Choice:
        q = self.queue(req.model)
        res = self.state.route(RouteRequest(req.model, req.priority, req.affinity, req.exclude, len(q) + 1))
        decision = admit(res, req.priority, len(q) if first else 0, self.cfg.queue_max, self.cfg.queue_timeout)
        if isinstance(decision, Wait):
            if isinstance(res, Choice):  # others queued first: give the slot back and line up
                self.state.release(res, None)
            self.metrics.queue.labels(req.model).inc()
            try:
                # Only the head of the queue routes: it is first in line, whatever waits behind it.
                res = q.wait(lambda: self.state.route(replace(req, queued=1)), self.cfg.queue_timeout)
            finally:
                self.metrics.queue.labels(req.model).dec()
            if res is None:
                self.metrics.shed.labels(req.model, "queue_timeout").inc()
                raise ApiError("shed", f"model {req.model!r} is saturated; try again later",
                               max(1, int(self.cfg.queue_timeout)))
            decision = res if isinstance(res, Rejection) else Send(res)
        if isinstance(decision, Send):
            return decision.choice
        if isinstance(decision, Shed):
            if isinstance(res, Choice):
                self.state.release(res, None)
            self.metrics.shed.labels(req.model, "saturated").inc()
            raise ApiError("shed", f"model {req.model!r} is saturated: {decision.reason}", decision.retry_after)
        assert isinstance(decision, Rejection)
        if decision.kind == "no_ready" and last_error is not None:
            raise last_error
        if decision.kind == "unknown_model" and req.model not in self.state.known_models:
            raise ApiError("model_not_found", f"model {req.model!r} does not exist")
        raise ApiError("no_replica", f"no Ready endpoint for model {req.model!r}")

    def _respond(self, resp, lease: "Lease", model: str, key: ApiKey | None, rid: str, t0: float,
                 t_send: float) -> RawAnswer:
        """Build the client's answer. On return the answer owns `resp` and `lease` (a stream releases
        them when it ends or the client leaves); if this raises, the caller still owns both."""
        choice = lease.choice
        ep = choice.endpoint
        mono = self.clock.monotonic
        streamed = resp.content_type.startswith("text/event-stream")
        # One pass over the engine's headers; X-Request-Id is ours (an engine echoing it would
        # otherwise send it twice), and a stream's caching headers are ours too.
        headers = response_headers(resp, STREAM_REPLACED if streamed else None)
        headers += [("X-Request-Id", rid), ("X-LLMGW-Endpoint", ep.id)]
        status = resp.status
        key_id = key.id if key else ANONYMOUS
        limited = bool(key and key.tpm)
        metrics = self.metrics

        def finish(completed: bool, usage) -> None:
            now = mono()
            ok = completed and status < 400
            lease.release((now - t_send) if ok else None, usage[1] if usage else None)
            child = metrics.child
            child(metrics.requests, model, ep.id, str(status) if completed else "aborted").inc()
            child(metrics.latency, model).observe(now - t0)
            if usage:
                child(metrics.tokens, model, "prompt").inc(usage[0])
                child(metrics.tokens, model, "completion").inc(usage[1])
            if status < 400:
                self.usage.record(key_id, ep.model or model, *(usage or (0, 0)), limited=limited)

        if streamed:
            deadline = t0 + self.cfg.total_timeout
            first = lambda: metrics.child(metrics.ttft, model).observe(mono() - t0)  # noqa: E731

            def finish_stream(completed: bool, usage) -> None:
                self.open -= 1  # counted by the WSGI entry, which left it to the stream
                finish(completed, usage)

            # Proxies in front (nginx) must not buffer the stream, nor anything cache it.
            headers += SSE_HEADERS
            body = StreamBody(resp, deadline, first, finish_stream, monotonic=mono)
            return RawAnswer(status, headers, body)
        try:
            payload = resp.read()
        except Exception as e:  # noqa: BLE001 - reported as a clean 502/504 below
            resp.close()
            finish(False, None)
            kind = "upstream_timeout" if "timed out" in str(e).lower() else "upstream_error"
            raise ApiError(kind, f"endpoint {ep.id} failed while answering: {type(e).__name__}") from None
        resp.release()
        metrics.child(metrics.ttft, model).observe(mono() - t0)
        finish(True, usage_from_json(payload) if status < 400 else None)
        headers.append(("Content-Length", str(len(payload))))
        return RawAnswer(status, headers, [payload])

    # --- other views -----------------------------------------------------------------------------
    def list_models(self) -> dict:
        self.authenticate(request.environ)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "llmgw"}
                for m in sorted(self.state.models())]
        return {"object": "list", "data": data}

    def readiness(self) -> tuple[dict, int]:
        """/readyz: 200 once this process has loaded the endpoint list (and the key table, unless
        auth is off), else 503 with the reason. For load balancers and compose healthchecks."""
        reason = self.not_ready()
        if reason is None:
            return {"ready": True, "endpoints_version": self.state.version}, 200
        return {"ready": False, "reason": reason}, 503

    def health(self) -> dict:
        h = self.state.health
        return {
            "status": "ok" if h.ok else "degraded",
            "redis": "ok" if h.ok else "unavailable",
            "redis_down_since": h.down_since,
            "redis_error": None if h.ok else h.last_error,
            "endpoints_version": self.state.version,
            "endpoints": len(self.state.endpoints),
            "models": sorted(self.state.models()),
            "inflight": sum(self.state.inflight.values()),
            "policy": self.cfg.routing.policy,
            "auth": self.keys.mode,
            "keys_loaded": self.keys.loaded,
            "ready": self.not_ready() is None,
            "open_requests": self.open,
            "max_open_requests": self.max_open,
            "pid": os.getpid(),
            # Whether this process serves on greenlets (gunicorn's gevent worker patched it).
            "gevent": "gevent.monkey" in sys.modules and sys.modules["gevent.monkey"].is_module_patched("socket"),
        }


def create_app(config: GatewaySettings | None = None, *, store: Store | None = None, clock: Clock | None = None) -> Flask:
    """Build the app. With no arguments (gunicorn) the config comes from the environment; tests pass a
    Store on fakeredis. Nothing runs in the background until `Gateway.serve` (gunicorn's
    post_worker_init, in the worker) or `Gateway.start`."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config or GatewaySettings.from_env()
    gw = Gateway(cfg, store=store, clock=clock)
    app = Flask("llmgw.gateway")
    app.extensions["llmgw"] = gw

    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes

    def not_served_here():  # the WSGI fast path below answers these; Flask keeps them for 405s
        raise ApiError("internal", "proxied route reached Flask")

    for path in PROXIED:
        app.add_url_rule(path, path, not_served_here, methods=["POST"])

    @app.get("/v1/models")
    def models():
        return gw.list_models()

    @app.get("/healthz")
    def healthz():
        return gw.health()

    @app.get("/readyz")
    def readyz():
        return gw.readiness()

    @app.get("/metrics")
    def metrics():
        return Response(gw.metrics.render(), mimetype=None, content_type=gw.metrics.content_type)

    @app.errorhandler(ApiError)
    def api_error(e: ApiError):
        return error_response(e, request.headers.get("X-Request-Id"))

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        kind = HTTP_KIND.get(e.code or 500, "internal" if (e.code or 500) >= 500 else "bad_request")
        return error_response(ApiError(kind, e.description or e.name), request.headers.get("X-Request-Id"))

    @app.errorhandler(Exception)
    def unexpected(e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError("internal", "internal error in the gateway; see its log"))

    flask_wsgi = app.wsgi_app
    proxied = frozenset(PROXIED)

    def wsgi(environ, start_response):
        """Proxied POSTs skip Flask's request machinery; everything else is a Flask view."""
        path = environ.get("PATH_INFO", "")
        if path not in proxied or environ.get("REQUEST_METHOD") != "POST":
            return flask_wsgi(environ, start_response)
        rid = environ.get("HTTP_X_REQUEST_ID") or uuid.uuid4().hex
        if gw.open >= gw.max_open:
            # Beyond the cap a flood gets a cheap answer instead of memory and file descriptors.
            gw.metrics.over_capacity.inc()
            return error_response(ApiError(
                "gateway_full", f"this gateway process already holds {gw.max_open} open requests "
                "(LLMGW_GATEWAY_MAX_CONNECTIONS); retry shortly", 1), rid)(environ, start_response)
        gw.open += 1
        handed_over = False
        try:
            resp = gw.proxy(path, environ, rid)
            handed_over = isinstance(resp.body, StreamBody)  # the stream gives the count back
        except ApiError as e:
            resp = error_response(e, rid)
        except Exception:  # noqa: BLE001 - never a traceback to the client
            log.exception("unhandled error on POST %s", path)
            resp = error_response(ApiError("internal", "internal error in the gateway; see its log"), rid)
        finally:
            if not handed_over:
                gw.open -= 1
        return resp(environ, start_response)

    app.wsgi_app = wsgi
    return app
