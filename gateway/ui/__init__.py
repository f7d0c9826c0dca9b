"""The web console at `/ui`: pages over the fleet, a playground to try a model, and the keys page, served
by the gateway itself (docs/console.md).

Plain HTML, CSS and JavaScript files in `static/` (no build step, nothing from a CDN), which poll the
JSON API below every 2 s. The API views are thin: read the facts (the fleet through `gateway.observe.fleet`,
cached for a second), call the pure builders of `gateway.ui.views`, answer.

    /ui                 the single page
    /ui/api/fleet       nodes and replicas: `llmgw status --json`
    /ui/api/models      per model and profile: replicas asked for and Ready, each replica's load, charts,
                        and per API key its weight, service, recent share and queue wait
    /ui/api/events      the event history, filtered, paged with `after`
    /ui/api/catalog     the applied catalog as YAML and its history (`?version=N` for a past one)
    /ui/api/batches     the Batch API's batches (running ones and the latest), progress and rate
    /ui/api/keys        the API keys: list, create, change, revoke (gateway.ui.keys; an admin's)

The playground page calls the gateway's own API (/v1/models, /v1/chat/completions, /v1/llmgw/usage,
/v1/llmgw/requests/{id}) with the key pasted into it, as any client does.

When API keys are in use the API needs an admin key (`KeyGate.require_admin`); with auth off, or before any
key exists (`LLMGW_GATEWAY_AUTH=auto`), it is open like the rest of the gateway.
"""

from __future__ import annotations

import functools
import re

from flask import Blueprint, Response, jsonify, request, send_from_directory

from gateway.errors import ApiError
from gateway.observe.fleet import FleetView
from gateway.observe.health import REDIS_ERRORS
from gateway.observe.traffic import SLOT, SLOTS, series, slot_of
from gateway.ui.keys import add_key_routes
from gateway.ui.views import catalog_view, models_view
from llmgw.batch.view import batch_row
from llmgw.catalog import read_applied, read_version
from llmgw.state import events
from llmgw.state.tenants import SHARE_MINUTES, service_rows

EVENTS_MAX = 1000  # events one answer carries at most
BATCHES_MAX = 50  # ended batches one answer lists (every running one is listed)
KEY_MISS_REFRESH = 1.0  # seconds between two re-reads of the key table for an unknown key


def console_blueprint(gw, fleet: FleetView) -> Blueprint:
    """The console of one gateway process (`gw`: its gateway.app.Gateway)."""
    bp = Blueprint("console", __name__, url_prefix="/ui", static_folder="static", static_url_path="/static")

    def served(view):
        """A JSON view (a body, or a body and a status), never cached; Redis errors are 503s."""
        @functools.wraps(view)
        def run(*args, **kw):
            try:
                body = view(*args, **kw)
            except REDIS_ERRORS as e:
                raise ApiError("unavailable", f"the console cannot read Redis: {type(e).__name__}: {e}") from None
            body, status = body if isinstance(body, tuple) else (body, 200)
            resp = jsonify(body)
            resp.status_code = status
            resp.headers["Cache-Control"] = "no-store"
            return resp
        return run

    missed = [float("-inf")]  # when an unknown key last made this process read the key table again

    def admin(open_without_keys: bool = False):
        """The caller's admin key (`KeyGate.require_admin`). A key this process does not know may have
        been made a moment ago (the keys page, on another worker, or the CLI): the table is read again
        then, at most once per KEY_MISS_REFRESH seconds, before the 401."""
        try:
            return gw.gate.require_admin(request.environ, open_without_keys=open_without_keys)
        except ApiError as e:
            now = gw.clock.monotonic()
            if e.kind != "unauthorized" or now - missed[0] < KEY_MISS_REFRESH:
                raise
            missed[0] = now
            gw.keys.refresh()
            return gw.gate.require_admin(request.environ, open_without_keys=open_without_keys)

    def api(view):
        """A read-only page's view: an admin key, or open while the gateway requires no key."""
        @functools.wraps(view)
        def gated(*args, **kw):
            admin(open_without_keys=True)
            return view(*args, **kw)
        return served(gated)

    @bp.get("")
    @bp.get("/")
    def page() -> Response:
        return send_from_directory(bp.static_folder, "index.html", max_age=0)

    @bp.get("/api/fleet")
    @api
    def fleet_api():
        return fleet.get().report

    @bp.get("/api/models")
    @api
    def models_api():
        f = fleet.get()
        loads = gw.store.loads(r["id"] for r in f.report["replicas"])
        # The learned time of a typical request alone on each endpoint (gateway.routing.speed).
        units = {eid: st.speed.ttfb + st.speed.decode(1) for eid, st in gw.router.stats.items()
                 if st.speed is not None}
        last = slot_of(f.now) - 1  # the last complete slot
        traffic = series(gw.store.traffic(range(last - SLOTS + 1, last + 1)), last)
        thresholds = {"max_waiting": gw.cfg.routing.max_waiting, "max_kv": gw.cfg.routing.max_kv}
        # Fair queueing per key (llmgw.state.tenants): weights, service, recent shares, queue waits.
        totals = gw.store.tenant_totals()
        minute = int(f.now // 60)
        recent = gw.store.tenant_minutes(list(totals), range(minute - SHARE_MINUTES + 1, minute + 1))
        tenants = service_rows({k.id: k for k in gw.keys.by_hash.values()}, totals, recent)
        return models_view(f.catalog, f.report, f.gateways, loads, units, traffic, thresholds, SLOT, f.now, tenants)

    @bp.get("/api/batches")
    @api
    def batches_api():
        store, now = gw.store, gw.clock.time()
        active, ended = store.batch_stats()
        recent = store.list_batches(None, limit=BATCHES_MAX)
        seen = {b.id for b in active}
        owners = store.key_names()
        rows = [batch_row(b, owners, now) for b in sorted(active + [b for b in recent if b.id not in seen],
                                                           key=lambda b: -b.created_at)]
        return {"batches": rows, "counts": ended}

    @bp.get("/api/events")
    @api
    def events_api():
        args = request.args
        filters = {"model": args.get("model") or None, "node": args.get("node") or None,
                   "kind": args.get("kind") or None}
        if (problem := events.kind_problem(filters["kind"])) is not None:
            raise ApiError("bad_request", f"kind: {problem}")
        try:
            limit = min(EVENTS_MAX, max(1, int(args.get("limit", 200))))
        except ValueError:
            raise ApiError("bad_request", f"limit: expected an integer, got {args.get('limit')!r}") from None
        after = args.get("after")
        if after and not re.fullmatch(r"\d+-\d+", after):
            raise ApiError("bad_request", f"after: expected an event id like 1717171717171-0, got {after!r}")
        if after:
            batch = gw.store.read_events(after=after, count=EVENTS_MAX)
            found = events.matching(batch, **filters)[-limit:]
            cursor = batch[-1].id if batch else after
        else:
            found = gw.store.latest_events(limit, **filters)
            newest = gw.store.latest_events(1)
            cursor = newest[-1].id if newest else "0-0"
        return {"events": [e.to_dict() for e in found], "cursor": cursor, "kinds": list(events.KINDS)}

    @bp.get("/api/catalog")
    @api
    def catalog_api():
        raw = request.args.get("version")
        past = gw.store.catalog_history(50)
        if raw:
            try:
                version = int(raw)
            except ValueError:
                raise ApiError("bad_request", f"version: expected an integer, got {raw!r}") from None
            found = read_version(gw.store, version)
            if found is None:
                raise ApiError("not_found", f"catalog version {version} is not in the history")
            return catalog_view(version, found[0], found[1], past)
        version, catalog, meta = read_applied(gw.store)
        return catalog_view(version, catalog, meta, past)

    add_key_routes(bp, gw, served, admin)  # the keys page: an admin's, through llmgw keys' code path
    return bp
