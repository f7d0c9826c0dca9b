"""The gateway's Flask app: the views that are not proxied (models, a key's usage, health, readiness,
metrics, the console) and the error handlers that give every failure an OpenAI-shaped body. The
proxied paths get Flask rules only so Flask answers their wrong methods with 405s; the WSGI entry
(gateway.http.wsgi) serves them.
"""

from __future__ import annotations

import logging
import os
import sys

from flask import Flask, Response, redirect, request
from werkzeug.exceptions import HTTPException

from gateway.errors import ApiError
from gateway.http import batches, served
from gateway.http.answer import error_response
from gateway.keys.policy import allows, unknown_model
from gateway.observe import batchmetrics, fleetmetrics
from gateway.observe.fleet import FleetView
from gateway.observe.health import REDIS_ERRORS
from gateway.request.surface import flask_rules
from gateway.routing.adapters import unique
from gateway.routing.tables import Snapshot
from gateway.ui import console_blueprint
from llmgw.state.keypolicy import budget_status, usage_by_model
from llmgw.state.budget import iso

log = logging.getLogger("llmgw.gateway")

USAGE_PATH = "/v1/llmgw/usage"  # a key's own usage and budget (JSON)
HTTP_KIND = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def model_cards(snap: Snapshot) -> list[dict]:
    """`GET /v1/models`: every name with a routable endpoint, OpenAI's fields and llmgw's: the
    model's other names, its endpoints' engines, how many are Ready, and the context length
    (the smallest any of them reports: a request must fit wherever it lands); then the models
    scaled to zero (a request starts them)."""
    cards = []
    for name, eps in sorted(snap.tables.models().items()):
        lengths = [rec.context_length for e in eps if (rec := snap.loads.get(e.id)) and rec.context_length]
        cards.append({
            "id": name, "object": "model", "created": 0, "owned_by": "llmgw",
            "aliases": [n for n in eps[0].models if n != name],
            "engines": sorted({e.engine for e in eps}),
            "ready_replicas": len(eps),
            "context_length": min(lengths) if lengths else None,
        })
    listed = {c["id"] for c in cards}
    return cards + [{"id": m, "object": "model", "created": 0, "owned_by": "llmgw", "aliases": [], "engines": [],
                     "ready_replicas": 0, "context_length": None}
                    for m in sorted(set(snap.tables.cold_start) - listed)] + adapter_cards(snap)


def adapter_cards(snap: Snapshot) -> list[dict]:
    """The LoRA adapters that are loaded, or can be (a replica serves them, or their model starts
    from zero), each with its base model as `parent` (as vLLM lists them)."""
    cards = []
    for a in unique(snap.tables.adapters):
        if not (a.holders or a.loadable):
            continue
        lengths = [rec.context_length for e in a.holders if (rec := snap.loads.get(e.id)) and rec.context_length]
        cards.append({"id": a.name, "object": "model", "created": 0, "owned_by": "llmgw", "parent": a.model,
                      "root": a.model, "aliases": list(a.names[1:]), "engines": sorted({e.engine for e in a.holders}),
                      "ready_replicas": len(a.holders), "context_length": min(lengths) if lengths else None})
    return cards


def list_models(gw) -> dict:
    """The models with a routable endpoint, and those scaled to zero; for a key with `--models`,
    only those it may call."""
    key = gw.gate.authenticate(request.environ)
    snap = gw.router.snapshot
    cards = model_cards(snap)
    if key is not None:
        gw.gate.enforce(key, None)
        cards = [c for c in cards if allows(key, snap.tables.names_of(c["id"]))]
    return {"object": "list", "data": sorted(cards, key=lambda c: c["id"])}


def find_card(cards: list[dict], name: str) -> dict | None:
    """`GET /v1/models/{name}`: the card `GET /v1/models` lists under `name`; for a name listed only
    as another card's alias (a LoRA adapter's), that card under the name asked, the way a model's
    aliases get their own cards. None when `name` is not listed."""
    for c in cards:
        if c["id"] == name:
            return c
    for c in cards:
        if name in c["aliases"]:
            return {**c, "id": name, "aliases": [c["id"], *(a for a in c["aliases"] if a != name)]}
    return None


def get_model(gw, name: str) -> dict:
    """One model as `GET /v1/models` lists it (OpenAI's retrieve); 404 `model_not_found` for a name
    it does not list, or one the key may not call (the same body, as for a request)."""
    key = gw.gate.authenticate(request.environ)
    snap = gw.router.snapshot
    if key is not None:
        gw.gate.enforce(key, None)
        if not allows(key, snap.tables.names_of(name)):
            raise ApiError("model_not_found", unknown_model(name))
    card = find_card(model_cards(snap), name)
    if card is not None:
        return card
    if name in snap.tables.known_models:
        raise ApiError("model_not_found", f"model {name!r} has no Ready replica now (it is in the catalog; "
                       "`GET /v1/models` lists the models that can answer)")
    raise ApiError("model_not_found", unknown_model(name))


def key_usage(gw) -> dict:
    """`GET /v1/llmgw/usage`: the caller's key, its policy, budget, usage per model and weight and
    recent shares (fair queueing). An admin key may ask about another with `?key=NAME`."""
    key = gw.gate.identify(request.environ)
    which = request.args.get("key")
    if which and which not in (key.id, key.name):
        gw.gate.require_admin(request.environ)
        found = gw.keys.find(which)
        if found is None:
            raise ApiError("not_found", f"no API key named {which!r}")
        key = found
    now = gw.clock.time()
    period = key.period(now)
    used = gw.usage.spent(key.id, period.id) if period is not None else 0
    try:
        per_model = usage_by_model(gw.store.key_usage(key.id))
    except REDIS_ERRORS as e:
        gw.health.failed(e)
        per_model = None  # the budget above is this gateway's own count, still known
    return {
        "key": key.name, "id": key.id, "models": list(key.models) or None,
        "expires_at": iso(key.expires_at) if key.expires_at is not None else None, "admin": key.admin,
        "rpm": key.rpm, "tpm": key.tpm, "budget": budget_status(key, used, now),
        "usage": None if per_model is None else [{"model": m, **row} for m, row in sorted(per_model.items())],
        # fair queueing: its share of a saturated model against the other keys', and, per model this
        # gateway process served it, its share of the service over the last minute (every gateway's)
        "weight": key.weight, "sub_tenants": key.sub_tenants,
        "shares": {m: s[key.id] for m in gw.ledger.models() if key.id in (s := gw.ledger.shares(m))},
    }


CONSOLE_PATH = "/ui"


def front_page():
    """`/`: a browser (it asks for HTML before JSON) is sent to the console; an API client gets a
    short JSON index of where things are."""
    if request.accept_mimetypes.best_match(("application/json", "text/html")) == "text/html":
        return redirect(CONSOLE_PATH, 302)
    return {"service": "llmgw gateway", "console": CONSOLE_PATH, "models": "/v1/models", "usage": USAGE_PATH,
            "health": "/healthz", "ready": "/readyz", "metrics": "/metrics"}


def readiness(gw) -> tuple[dict, int]:
    """/readyz: 200 once this process has loaded the endpoint list (and the key table, unless
    auth is off), else 503 with the reason. For load balancers and compose healthchecks."""
    reason = gw.not_ready()
    if reason is None:
        return {"ready": True, "endpoints_version": gw.router.tables.version}, 200
    return {"ready": False, "reason": reason}, 503


def health(gw) -> dict:
    h, tables = gw.health, gw.router.tables
    return {
        "status": "ok" if h.ok else "degraded",
        "redis": "ok" if h.ok else "unavailable",
        "redis_down_since": h.down_since,
        "redis_error": None if h.ok else h.last_error,
        "endpoints_version": tables.version,
        "endpoints": len(tables.endpoints),
        "models": sorted(tables.models()),
        "inflight": sum(gw.router.inflight.values()),
        "policy": gw.cfg.routing.policy,
        "auth": gw.keys.mode,
        "keys_loaded": gw.keys.loaded,
        # Variables external servers' keys are read from, missing here (their endpoints are skipped).
        "missing_key_variables": sorted(set(tables.missing_keys.values())),
        "ready": gw.not_ready() is None,
        "open_requests": gw.open,
        "max_open_requests": gw.max_open,
        "pid": os.getpid(),
        # Whether this process serves on greenlets (gunicorn's gevent worker patched it).
        "gevent": "gevent.monkey" in sys.modules and sys.modules["gevent.monkey"].is_module_patched("socket"),
    }


def flask_app(gw) -> Flask:
    """The Flask app of one gateway process (`gw`: its gateway.app.Gateway)."""
    app = Flask("llmgw.gateway")
    app.extensions["llmgw"] = gw
    app.config["MAX_CONTENT_LENGTH"] = gw.cfg.max_body_bytes

    def not_served_here():  # the WSGI entry answers these; Flask keeps them for 405s
        raise ApiError("internal", "proxied route reached Flask")

    for rule, methods in flask_rules():
        app.add_url_rule(rule, rule, not_served_here, methods=methods)

    app.add_url_rule("/", "front", front_page)
    app.add_url_rule("/v1/models", "models", lambda: list_models(gw))
    # <path:>: a name may hold a slash (`org/model`; the openai client sends it as %2F, decoded here).
    app.add_url_rule("/v1/models/<path:name>", "model", lambda name: get_model(gw, name))
    app.add_url_rule(USAGE_PATH, "key_usage", lambda: key_usage(gw))
    app.add_url_rule("/healthz", "healthz", lambda: health(gw))
    app.add_url_rule("/readyz", "readyz", lambda: readiness(gw))
    app.add_url_rule("/metrics", "metrics", lambda: Response(gw.metrics.render(), mimetype=None,
                                                             content_type=gw.metrics.content_type))
    batches.register(app, gw)  # /v1/files, /v1/batches (docs/batch.md)
    served.register(app, gw)  # /v1/llmgw/requests/{id}: how an explained request was served

    fleet = FleetView(gw.store, gw.clock)  # the console and the fleet metrics share one cached read
    app.register_blueprint(console_blueprint(gw, fleet))

    @app.get("/metrics/fleet")
    def fleet_metrics():
        try:
            body = fleetmetrics.render(fleet.get()) + batchmetrics.render(*gw.store.batch_stats())
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

    return app
