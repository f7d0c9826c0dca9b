"""The gateway app factory and its thin views: `gunicorn -c python:gateway.gunicorn_conf 'gateway:create_app()'`.

The request path is: match the path (gateway.surface), read the body (size-capped), read just enough
of it to find the model (a JSON object's `model`/`stream`/`user`, a multipart form's `model` field,
or the endpoint a response id leads to), check the key against the in-memory table, pick an endpoint
that serves the operation from in-memory tables (gateway.routing), forward over a pooled connection
and stream back. Everything that needs Redis for routing happens in
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
from typing import Mapping

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException
from werkzeug.http import HTTP_STATUS_CODES

from gateway import fleetmetrics
from gateway.admission import Send, Shed, Wait, WaitQueue, admit, drain_time
from gateway.auth import ApiKey, KeyTable, RateLimiter, UsageRecorder
from gateway.coldstart import DemandSignal, hold, retry_after
from gateway.config import DEFAULT_MAX_CONNECTIONS, GatewaySettings
from gateway.errors import ApiError, error_response
from gateway.fleet import FleetView
from gateway.metrics import Metrics
from gateway.policy import Deny, ModelRef, allows, decide
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
from gateway.forms import FormError, find_field
from gateway.relay import relay, relay_target
from gateway.report import Identity, report_ttl
from gateway.responses import IdRewrite, unwrap
from gateway.retry import Deliver, GiveUp, Outcome, next_attempt
from gateway.routing import Choice, Rejection, RouteRequest
from gateway.saturation import Episode, SaturationSignals
from gateway.saturation import step as saturation_step
from gateway.state import REDIS_ERRORS, GatewayState
from gateway.surface import Route, engine_path, flask_rules, match
from gateway.traffic import KEEP as TRAFFIC_KEEP
from gateway.traffic import TrafficCounter
from gateway.ui import console_blueprint
from llmgw import surface as op
from llmgw.state.apikeys import ANONYMOUS, PRIORITIES, budget_status, cap_priority, usage_by_model
from llmgw.state.budget import iso
from llmgw.state.clock import Clock
from llmgw.state.kicks import Kicker, broker_app, celery_sender
from llmgw.state.records import EndpointInfo
from llmgw.state.store import Store, connect

log = logging.getLogger("llmgw.gateway")

USAGE_PATH = "/v1/llmgw/usage"  # a key's own usage and budget (JSON)
SSE_HEADERS = [("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")]
# At most one model_saturated (model_recovered) event per model in this many seconds, fleet-wide.
SATURATION_EVENT_EVERY = 5.0
HTTP_KIND = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


class RawAnswer:
    """A proxied answer as a bare WSGI app: status, headers and body iterable as they are (werkzeug's
    Response cost ~0.05 ms per request here and added nothing). A stream's body is the StreamBody,
    whose `close()` the server calls."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list[tuple[str, str]], body):
        self.status, self.headers, self.body = status, headers, body

    def start(self, start_response) -> None:
        try:
            start_response(f"{self.status} {HTTP_STATUS_CODES.get(self.status, 'UNKNOWN')}", self.headers)
        except BaseException:
            # The server refused the head (an engine's malformed header, say): it will never close the
            # body, so give back what the body holds (the upstream connection, the slot) here.
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
            raise

    def __call__(self, environ, start_response):
        self.start(start_response)
        return self.body


class Lease:
    """One reserved in-flight slot on an endpoint; `release` gives it back once, however often called
    (the request path's `finally` and the answer's completion may both reach it)."""

    __slots__ = ("state", "choice", "done")

    def __init__(self, state: GatewayState, choice: Choice):
        self.state, self.choice, self.done = state, choice, False

    def release(self, service_time: float | None = None, tokens: int | None = None,
                ttfb: float | None = None) -> None:
        if not self.done:
            self.done = True
            self.state.release(self.choice, service_time, tokens, ttfb)


class Call:
    """One proxied request as the gateway read it: the model it names, and what to send to whichever
    endpoint takes it (the body with the endpoint's served name, the engine's path)."""

    __slots__ = ("route", "model", "data", "body", "form_at", "pin", "response_id", "previous", "query")

    def __init__(self, route: Route, model: str, data: bytes | None = None, body: dict | None = None,
                 form_at: tuple[int, int] | None = None, pin: str | None = None,
                 response_id: tuple[str, str] | None = None, previous: tuple[str, str] | None = None,
                 query: str = ""):
        self.route, self.model, self.data, self.body, self.form_at = route, model, data, body, form_at
        self.pin = pin  # the endpoint a response id leads to
        self.response_id = response_id  # (client id, engine id) named by the path
        self.previous = previous  # (client id, engine id) of a JSON body's previous_response_id
        self.query = query

    def request_for(self, ep: EndpointInfo) -> tuple[str, bytes | None]:
        """The engine's path and the body for endpoint `ep`."""
        path = engine_path(ep.path(self.route.op), self.response_id[1] if self.response_id else None)
        if self.query:
            path += "?" + self.query
        served = ep.served_name or ep.model or self.model
        if self.body is not None:
            changes = {}
            if served != self.model:
                changes["model"] = served
            if self.previous is not None:
                changes["previous_response_id"] = self.previous[1]
            return path, (json.dumps({**self.body, **changes}).encode() if changes else self.data)
        if self.form_at is not None and served != self.model:
            start, end = self.form_at
            return path, self.data[:start] + served.encode() + self.data[end:]
        return path, self.data

    def rewrite(self, ep: EndpointInfo) -> IdRewrite | None:
        """How the endpoint's response ids become the client's, for the Responses operations."""
        if self.route.op not in RESPONSE_OPS:
            return None
        known = {pair[1]: pair[0] for pair in (self.response_id, self.previous) if pair is not None}
        return IdRewrite(ep.id, known, learn=True)


RESPONSE_OPS = frozenset({op.RESPONSES, op.RESPONSES_GET, op.RESPONSES_DELETE, op.RESPONSES_CANCEL})


class Gateway:
    """Everything one gateway process holds: config, tables, clients, metrics, queues."""

    def __init__(self, cfg: GatewaySettings, store: Store | None = None, clock: Clock | None = None,
                 request_store: Store | None = None, environ: Mapping[str, str] | None = None):
        self.cfg = cfg
        self.clock = clock or Clock()
        self.metrics = Metrics()
        self.store = store or Store(connect(cfg.redis_url))
        # The request path gets its own client with short timeouts: a hung Redis must not hang requests.
        self.rstore = request_store or (
            self.store if store is not None
            else Store(connect(cfg.redis_url, socket_timeout=cfg.redis_timeout, socket_connect_timeout=cfg.redis_timeout))
        )
        self.state = GatewayState(self.store, cfg, self.clock, self.metrics, environ=environ)
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
        # The console's charts and the saturation events (gateway.traffic, gateway.saturation).
        self.traffic = TrafficCounter(self.clock.time)
        self.saturation = SaturationSignals()
        self.episodes: dict[str, Episode] = {}
        self.demand = DemandSignal(
            self.store, lambda: Kicker(self.store, celery_sender(broker_app(cfg.redis_url)), enabled=cfg.event_driven),
            self.clock.time, self.clock.monotonic)
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
                self.usage.flush(self.keys.budget_periods(self.clock.time()))
                self.flush_traffic()
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("key/usage refresh failed")
            self.stopping.wait(self.cfg.usage_flush)

    def flush_traffic(self) -> None:
        """Add this process's traffic counts to Redis (dropped on failure: they only feed charts), and
        put a saturation episode's start and end in the event history."""
        counts = self.traffic.take()
        if counts:
            try:
                self.store.add_traffic(counts, TRAFFIC_KEEP)
            except REDIS_ERRORS as e:
                self.state.health.failed(e)
        self.episodes, news = saturation_step(self.episodes, self.saturation.take(), self.clock.time())
        for n in news:
            self.store.emit_limited(n.kind, n.message, subject=n.model, every=SATURATION_EVENT_EVERY,
                                    source=f"gateway:{self.identity.id}", model=n.model, queued=n.queued,
                                    shed=n.shed)

    def refused(self, environ: dict, err: ApiError) -> None:
        """A proxied request ended in an error answer: count it for its model's charts (only known
        models have one), and a shed one as a sign of saturation."""
        model = environ.get("llmgw.model")
        if model is None:
            return
        shed = err.kind in ("shed", "rate_limited")
        self.traffic.request(model, error=err.status >= 500, shed=shed)
        if err.kind == "shed":
            self.saturation.shed(model)

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
        return self._presented_key(environ)

    def _presented_key(self, environ: dict) -> ApiKey:
        auth = environ.get("HTTP_AUTHORIZATION", "")
        presented = auth[7:].strip() if auth[:7].lower() == "bearer " else environ.get("HTTP_API_KEY")
        if not presented:
            raise ApiError("unauthorized", "missing API key: send 'Authorization: Bearer <key>'")
        key = self.keys.lookup(presented)
        if key is None:
            raise ApiError("unauthorized", "invalid API key")
        return key

    def identify(self, environ: dict) -> ApiKey:
        """The caller's key, whatever LLMGW_GATEWAY_AUTH says (a request about a key needs one): 401
        without a valid, unexpired key."""
        if not self.keys.loaded:
            raise ApiError("auth_unavailable", self.not_ready() or "the gateway has not loaded its API keys yet", 1)
        key = self._presented_key(environ)
        self.enforce(key, None)
        return key

    def require_admin(self, environ: dict, open_without_keys: bool = False) -> ApiKey | None:
        """For the admin APIs: the caller's key if it is an admin key (`llmgw keys create|update
        --admin`); 401 without a valid key, 403 with an ordinary one. In every auth mode:
        `LLMGW_GATEWAY_AUTH=off` opens the OpenAI API, never the admin APIs that act on keys. The
        read-only console (`open_without_keys`) is open while the gateway requires no key at all
        (auth off, or `auto` before any key exists), like the rest of the gateway; then None."""
        if open_without_keys and (self.keys.mode == "off" or (self.keys.loaded and not self.keys.required)):
            return None
        key = self.identify(environ)
        if not key.admin:
            raise ApiError("forbidden", f"API key {key.name!r} is not an admin key; the console and the admin APIs "
                                        "need one (llmgw keys create NAME --admin)")
        return key

    def enforce(self, key: ApiKey, model: str | None) -> None:
        """The key's policy (gateway.policy.decide) over the in-memory tables; raises the denial."""
        now = self.clock.time()
        period = key.period(now)
        used = self.usage.spent(key.id, period.id) if period is not None else 0
        d = decide(key, ModelRef(model, self.state.names_of(model)) if model is not None else None, used, now)
        if isinstance(d, Deny):
            self.metrics.child(self.metrics.denied, d.kind).inc()
            raise ApiError(d.kind, d.message, d.retry_after)

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
        if len(data) < length:  # the client stopped sending: never forward what may be half a request
            raise ApiError("bad_request", f"request body ended after {len(data)} of the {length} bytes "
                                          "its Content-Length says")
        return data

    def read_call(self, route: Route, response_id: str | None, environ: dict) -> Call:
        """Read what routing needs from the request: the body's model (JSON or a form field), or the
        endpoint a response id leads to. Raises ApiError (400, 404, 413) for what cannot be sent."""
        if route.body == "none":
            return self._call_by_id(route, response_id or "", environ.get("QUERY_STRING", ""))
        data = self.read_body(environ)
        if route.body == "form":
            try:
                found = find_field(data, environ.get("CONTENT_TYPE", ""), "model")
            except FormError as e:
                raise ApiError("bad_request", str(e)) from None
            if found is None or not found[0]:
                raise ApiError("missing_model", "the form field 'model' is required")
            return Call(route, found[0], data, form_at=found[1:])
        try:
            body = json.loads(data)
        except ValueError as e:  # UnicodeDecodeError included: not UTF-8
            raise ApiError("bad_request", f"request body is not valid JSON: {e}") from None
        except RecursionError:  # valid or not, nested deeper than the parser's stack allows
            raise ApiError("bad_request", "request body is not valid JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise ApiError("bad_request", "request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError("missing_model", "'model' is required and must be a non-empty string")
        previous = body.get("previous_response_id") if route.op == op.RESPONSES else None
        if previous is None:
            return Call(route, model, data, body)
        if not isinstance(previous, str):
            raise ApiError("bad_request", "'previous_response_id' must be a string")
        ep, engine_id = self._response_endpoint(previous, "previous_response_id")
        if model not in ep.models:
            raise ApiError("bad_request", f"previous_response_id {previous!r} belongs to model {ep.model!r}, "
                           f"not {model!r}")
        return Call(route, model, data, body, pin=ep.id, previous=(previous, engine_id))

    def _call_by_id(self, route: Route, response_id: str, query: str) -> Call:
        ep, engine_id = self._response_endpoint(response_id, "response")
        return Call(route, ep.model or ep.models[0], pin=ep.id, response_id=(response_id, engine_id), query=query)

    def _response_endpoint(self, client_id: str, what: str) -> tuple[EndpointInfo, str]:
        """The endpoint a response id leads to, and the engine's own id; 404 when it leads nowhere."""
        parsed = unwrap(client_id)
        if parsed is None:
            raise ApiError("not_found", f"{what} {client_id!r} is not a response id this gateway issued")
        ep = self.state.by_ref.get(parsed[0])
        if ep is None:
            raise ApiError("not_found", f"{what} {client_id!r} was created by an endpoint that is no longer "
                           "serving; its stored responses are gone with it")
        var = self.state.missing_keys.get(ep.id)
        if var is not None:
            raise ApiError("no_replica", f"{what} {client_id!r} is held by endpoint {ep.id}, whose API key "
                           f"variable {var} is not set in this gateway's environment", 1)
        return ep, parsed[1]

    def proxy(self, route: Route, response_id: str | None, environ: dict, rid: str) -> RawAnswer:
        """The proxied request, on the raw WSGI environ (Flask's request machinery is skipped: it cost
        ~0.3 ms per request, as much as the rest of the gateway's work)."""
        mono = self.clock.monotonic
        t0 = mono()
        if route.by_id:  # who asks, before saying whether a response exists
            key = self.authenticate(environ)
            if not self.state.loaded_once:
                raise ApiError("no_replica", self.not_ready() or "the gateway has not loaded the endpoint list yet", 1)
        call = self.read_call(route, response_id, environ)
        model = call.model
        if not route.by_id:
            key = self.authenticate(environ)
        # Reading, deleting or cancelling a stored response generates nothing: never queued or shed.
        prio = "critical" if route.by_id else self.priority(environ.get("HTTP_X_LLMGW_PRIORITY") or None, key)
        if not self.state.loaded_once:
            raise ApiError("no_replica", self.not_ready() or "the gateway has not loaded the endpoint list yet", 1)
        if key is not None:
            self.enforce(key, model)  # expiry, the key's models, its budget: 401 / 404 / 429
            if (key.budget and call.body is not None and call.body.get("stream") is True
                    and route.op in (op.CHAT, op.COMPLETIONS)):  # the Responses API's stream ends with its usage
                call.body, call.data = with_stream_usage(call.body, call.data)
        if model not in self.state.known_models:
            # Unknown names get no per-name state and no metric label of their own (cardinality).
            self.metrics.rejected_unknown.inc()
            raise ApiError("model_not_found", f"model {model!r} does not exist")
        if not route.by_id:
            self.state.requested(model)
        environ["llmgw.model"] = self.state.canonical.get(model, model)  # known: charts may count it
        if key is not None:
            limited = self.limiter.check(key)
            if limited:
                self.metrics.shed.labels(model, "rate_limited").inc()
                raise ApiError("rate_limited", f"rate limit of {limited[0]} reached for key {key.name!r}", limited[1])
        user = call.body.get("user") if call.body is not None else None
        affinity = environ.get("HTTP_X_SESSION_ID") or (user if isinstance(user, str) and user else None)

        headers = {h: v for h, var in FORWARD_REQUEST_HEADERS if (v := environ.get(var))}
        headers["x-request-id"] = rid
        if call.data is not None:
            headers.setdefault("content-type", "application/json")
        method = environ.get("REQUEST_METHOD", "POST")
        exclude: set[str] = set()
        last_error: ApiError | None = None
        attempt = 0
        while True:
            req = RouteRequest(model, prio, affinity, frozenset(exclude), op=route.op, pin=call.pin)
            choice = self._admit(req, first=(attempt == 0), last_error=last_error)
            # From here the slot is ours: every path out of this block gives it back exactly once.
            lease = Lease(self.state, choice)
            resp = None
            try:
                ep = choice.endpoint
                path, out = call.request_for(ep)
                api_key = self.state.api_keys.get(ep.id)
                # An external server's own key, for this attempt only (never the client's, never
                # another endpoint's).
                sent = headers if api_key is None else {**headers, "authorization": f"Bearer {api_key}"}
                t_send = mono()
                try:
                    # The engine's credential, or an external server's own key (for this attempt only);
                    # never the client's key (FORWARD_REQUEST_HEADERS drops it), never another endpoint's.
                    secret = self.state.api_keys.get(ep.id) or ep.engine_secret
                    sent = {**headers, "authorization": f"Bearer {secret}"} if secret else headers
                    resp = self.upstream.send(ep.url, path, out, sent, method)
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
                    answer = self._respond(resp, lease, model, key, rid, t0, t_send, route, call.rewrite(ep))
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
        res = self.state.route(RouteRequest(req.model, req.priority, req.affinity, req.exclude, len(q) + 1,
                                            op=req.op, pin=req.pin))
        if isinstance(res, Rejection) and res.kind == "unknown_model" and req.model in self.state.cold_start:
            return self._cold_start(req, q, self.state.cold_start[req.model])
        # How long the queue would take to reach this request; only worth computing when it may wait.
        drain = (drain_time(len(q) + 1, self.state.completion_rate(req.model))
                 if isinstance(res, Rejection) and res.kind == "saturated" else None)
        decision = admit(res, req.priority, len(q) if first else 0, self.cfg.queue_max, self.cfg.queue_timeout, drain)
        if isinstance(decision, Wait):
            if isinstance(res, Choice):  # others queued first: give the slot back and line up
                self.state.release(res, None)
            self.saturation.queued(self.state.canonical.get(req.model, req.model))
            self.metrics.queue.labels(req.model).inc()
            entered = self.clock.monotonic()
            try:
                # Only the head of the queue routes: it is first in line, whatever waits behind it.
                res = q.wait(lambda: self.state.route(replace(req, queued=1, waited=self.clock.monotonic() - entered)),
                             self.cfg.queue_timeout)
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
        if decision.kind == "unsupported":
            method, path = op.OPERATIONS[req.op]
            who = f"endpoint {req.pin}" if req.pin else f"no endpoint of model {req.model!r}"
            raise ApiError("unsupported", f"{who} serves {method} {path}: {decision.detail}")
        keyless = sorted({var for eid, var in self.state.missing_keys.items()
                          if req.model in self.state.by_id[eid].models})
        if keyless:
            raise ApiError("no_replica", f"no Ready endpoint for model {req.model!r} this gateway can send to: "
                           f"the API key variable(s) {', '.join(keyless)} are not set in its environment", 1)
        raise ApiError("no_replica", f"no Ready endpoint for model {req.model!r}")

    def _cold_start(self, req: RouteRequest, q: WaitQueue, timeout: float) -> Choice:
        """The model has no endpoint and scales to zero: hold the request in its queue until a replica
        is published (gateway.coldstart), telling the control plane at once."""
        decision = hold(timeout, len(q), self.cfg.queue_max)
        if isinstance(decision, Shed):
            self.metrics.shed.labels(req.model, "cold_start").inc()
            raise ApiError("shed", f"model {req.model!r} is starting: {decision.reason}", decision.retry_after)
        model = self.state.canonical.get(req.model, req.model)
        if self.demand.demand(model, len(q) + 1):
            log.info("model %s has no Ready replica: holding its requests up to %gs for a cold start", model, timeout)
        self.metrics.queue.labels(req.model).inc()
        try:
            res = q.wait(lambda: self.state.route(replace(req, queued=1)), decision.timeout,
                         keep=("saturated", "unknown_model"))
        finally:
            self.metrics.queue.labels(req.model).dec()
        if isinstance(res, Choice):
            return res
        self.metrics.shed.labels(req.model, "cold_start_timeout").inc()
        raise ApiError("no_replica", f"model {req.model!r} is starting (scaling up from zero): no replica was "
                       f"Ready within {timeout:g}s; retry shortly", retry_after(timeout))

    def _respond(self, resp, lease: "Lease", model: str, key: ApiKey | None, rid: str, t0: float,
                 t_send: float, route: Route, rewrite: IdRewrite | None = None) -> RawAnswer:
        """Build the client's answer. On return the answer owns `resp` and `lease` (a stream releases
        them when it ends or the client leaves); if this raises, the caller still owns both.

        Only generating operations teach the router an endpoint's speed; a stored response read
        again (by id) is not usage again."""
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
        budgeted = key if key is not None and key.budget else None
        metrics = self.metrics
        traffic, canon = self.traffic, self.state.canonical.get(model, model)

        learns, counts = route.learns, not route.by_id
        first_at: list[float] = []  # when the stream's first bytes came (once per request, not per chunk)

        def finish(completed: bool, usage, charted: bool = True) -> None:
            now = mono()
            ok = completed and status < 400
            usage = usage if counts else None
            lease.release((now - t_send) if ok and learns else None, usage[1] if usage and learns else None,
                          (first_at[0] - t_send) if ok and learns and first_at else None)
            child = metrics.child
            child(metrics.requests, model, ep.id, str(status) if completed else "aborted").inc()
            child(metrics.latency, model).observe(now - t0)
            if charted:  # else the error answer raised next is counted, by Gateway.refused
                traffic.request(canon, error=not completed or status >= 500, seconds=now - t0)
            if usage:
                child(metrics.tokens, model, "prompt").inc(usage[0])
                child(metrics.tokens, model, "completion").inc(usage[1])
            if status < 400:
                self.usage.record(key_id, ep.model or model, *(usage or (0, 0)), limited=limited,
                                  budget=budgeted.period(self.clock.time()) if budgeted else None)

        if streamed:
            deadline = t0 + self.cfg.total_timeout

            def first() -> None:
                first_at.append(mono())
                waited = first_at[0] - t0
                metrics.child(metrics.ttft, model).observe(waited)
                traffic.first_byte(canon, waited)

            def finish_stream(completed: bool, usage) -> None:
                self.open -= 1  # counted by the WSGI entry, which left it to the stream
                finish(completed, usage)

            # Proxies in front (nginx) must not buffer the stream, nor anything cache it.
            headers += SSE_HEADERS
            body = StreamBody(resp, deadline, first, finish_stream, monotonic=mono,
                              rewrite=rewrite.chunk if rewrite is not None else None)
            return RawAnswer(status, headers, body)
        try:
            payload = resp.read()
        except Exception as e:  # noqa: BLE001 - reported as a clean 502/504 below
            resp.close()
            finish(False, None, charted=False)
            kind = "upstream_timeout" if "timed out" in str(e).lower() else "upstream_error"
            raise ApiError(kind, f"endpoint {ep.id} failed while answering: {type(e).__name__}") from None
        resp.release()
        if rewrite is not None and status < 400:
            payload = rewrite.body(payload)
        metrics.child(metrics.ttft, model).observe(mono() - t0)
        traffic.first_byte(canon, mono() - t0)
        finish(True, usage_from_json(payload) if status < 400 else None)
        headers.append(("Content-Length", str(len(payload))))
        return RawAnswer(status, headers, [payload])

    # --- other views -----------------------------------------------------------------------------
    def list_models(self) -> dict:
        """The models with a routable endpoint, and those scaled to zero (a request starts them);
        for a key with `--models`, only those it may call."""
        key = self.authenticate(request.environ)
        cards = self.state.model_cards()
        listed = {c["id"] for c in cards}
        cards += [{"id": m, "object": "model", "created": 0, "owned_by": "llmgw", "aliases": [], "engines": [],
                   "ready_replicas": 0, "context_length": None}
                  for m in sorted(set(self.state.cold_start) - listed)]
        if key is not None:
            self.enforce(key, None)
            cards = [c for c in cards if allows(key, self.state.names_of(c["id"]))]
        return {"object": "list", "data": sorted(cards, key=lambda c: c["id"])}

    def key_usage(self) -> dict:
        """`GET /v1/llmgw/usage`: the caller's key, its policy, budget and usage per model. An admin key
        may ask about another with `?key=NAME`."""
        key = self.identify(request.environ)
        which = request.args.get("key")
        if which and which not in (key.id, key.name):
            self.require_admin(request.environ)
            found = self.keys.find(which)
            if found is None:
                raise ApiError("not_found", f"no API key named {which!r}")
            key = found
        now = self.clock.time()
        period = key.period(now)
        used = self.usage.spent(key.id, period.id) if period is not None else 0
        try:
            per_model = usage_by_model(self.store.key_usage(key.id))
        except REDIS_ERRORS as e:
            self.state.health.failed(e)
            per_model = None  # the budget above is this gateway's own count, still known
        return {
            "key": key.name, "id": key.id, "models": list(key.models) or None,
            "expires_at": iso(key.expires_at) if key.expires_at is not None else None, "admin": key.admin,
            "rpm": key.rpm, "tpm": key.tpm, "budget": budget_status(key, used, now),
            "usage": None if per_model is None else [{"model": m, **row} for m, row in sorted(per_model.items())],
        }

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
            # Variables external servers' keys are read from, missing here (their endpoints are skipped).
            "missing_key_variables": sorted(set(self.state.missing_keys.values())),
            "ready": self.not_ready() is None,
            "open_requests": self.open,
            "max_open_requests": self.max_open,
            "pid": os.getpid(),
            # Whether this process serves on greenlets (gunicorn's gevent worker patched it).
            "gevent": "gevent.monkey" in sys.modules and sys.modules["gevent.monkey"].is_module_patched("socket"),
        }


def with_stream_usage(body: dict, data: bytes) -> tuple[dict, bytes]:
    """A streamed request of a key with a budget asks the engine for the usage chunk at its end
    (`stream_options.include_usage`), so its tokens are counted; the client then receives that chunk."""
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_usage") is True:
        return body, data
    body = {**body, "stream_options": {**(opts if isinstance(opts, dict) else {}), "include_usage": True}}
    return body, json.dumps(body).encode()


def create_app(config: GatewaySettings | None = None, *, store: Store | None = None, clock: Clock | None = None,
               environ: Mapping[str, str] | None = None) -> Flask:
    """Build the app. With no arguments (gunicorn) the config comes from the environment; tests pass a
    Store on fakeredis. Nothing runs in the background until `Gateway.serve` (gunicorn's
    post_worker_init, in the worker) or `Gateway.start`."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config or GatewaySettings.from_env()
    gw = Gateway(cfg, store=store, clock=clock, environ=environ)
    app = Flask("llmgw.gateway")
    app.extensions["llmgw"] = gw

    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes

    def not_served_here():  # the WSGI fast path below answers these; Flask keeps them for 405s
        raise ApiError("internal", "proxied route reached Flask")

    for rule, methods in flask_rules():
        app.add_url_rule(rule, rule, not_served_here, methods=methods)

    @app.get("/v1/models")
    def models():
        return gw.list_models()

    @app.get(USAGE_PATH)
    def key_usage():
        return gw.key_usage()

    @app.get("/healthz")
    def healthz():
        return gw.health()

    @app.get("/readyz")
    def readyz():
        return gw.readiness()

    @app.get("/metrics")
    def metrics():
        return Response(gw.metrics.render(), mimetype=None, content_type=gw.metrics.content_type)

    fleet = FleetView(gw.store, gw.clock)  # the console and the fleet metrics share one cached read
    app.register_blueprint(console_blueprint(gw, fleet))

    @app.get("/metrics/fleet")
    def fleet_metrics():
        try:
            body = fleetmetrics.render(fleet.get())
        except REDIS_ERRORS as e:
            raise ApiError("unavailable", f"the fleet metrics cannot read Redis: {type(e).__name__}: {e}") from None
        return Response(body, mimetype=None, content_type=gw.metrics.content_type)

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

    def wsgi(environ, start_response):
        """Proxied requests skip Flask's request machinery; everything else is a Flask view."""
        path = environ.get("PATH_INFO", "")
        matched = match(environ.get("REQUEST_METHOD", ""), path)
        if matched is None:
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
            resp = gw.proxy(matched[0], matched[1], environ, rid)
            handed_over = isinstance(resp.body, StreamBody)  # the stream gives the count back
        except ApiError as e:
            gw.refused(environ, e)
            resp = error_response(e, rid)
        except Exception:  # noqa: BLE001 - never a traceback to the client
            log.exception("unhandled error on %s %s", environ.get("REQUEST_METHOD"), path)
            resp = error_response(ApiError("internal", "internal error in the gateway; see its log"), rid)
        finally:
            if not handed_over:
                gw.open -= 1
        if handed_over:
            gresp = relay_target(environ, start_response)
            if gresp is not None:  # gunicorn's gevent worker: the stream goes straight to the socket
                return relay(resp, gresp, start_response)
        return resp(environ, start_response)

    app.wsgi_app = wsgi
    return app
