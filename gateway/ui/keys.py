"""The console's keys page: list, create, change and revoke API keys, for an admin (docs/console.md#keys).

The same code path as `llmgw keys`: the form's fields are the CLI's flags by their names, read by
`llmgw.state.keypolicy.key_changes`, and written by the store's `create_key`, `update_key` and
`revoke_key`, which put each change in the event history naming the admin key that made it. A new
key's secret is in the answer to its creation only.

    GET    /ui/api/keys              {keys: [the records, never a hash], fields, bootstrap}
    POST   /ui/api/keys              {name, <field>: value, ...}    -> 201 {key (the secret, once), record, note}
    PATCH  /ui/api/keys/<name or id> {<field>: value, ...}          -> {record, note}
    DELETE /ui/api/keys/<name or id>                                -> {revoked}

An admin key always (`LLMGW_GATEWAY_AUTH=off` opens the OpenAI API, never what acts on keys), with
one exception: while `LLMGW_GATEWAY_AUTH=auto` requires no key because none exists, the console
may create the first key, which is an admin key (whoever reaches the gateway can use all of it
then; that key closes it).
"""

from __future__ import annotations

from flask import Blueprint, request

from gateway.errors import ApiError
from llmgw.errors import NotFound, NotReplicated
from llmgw.state.keypolicy import KEY_FIELDS, ApiKeyInvalid, describe_key, key_changes, unlisted_models


def _row(rec) -> dict:
    return {**rec.public(), "describe": describe_key(rec)}


def add_key_routes(bp: Blueprint, gw, api, require_admin) -> None:
    """Add the keys API to the console's blueprint; `api` wraps a view (JSON, no-store, Redis errors)
    without the console's own gate: each view here asks for what it needs (`require_admin()`: the
    caller's admin key, the console's)."""

    def bootstrapping() -> bool:
        """No key exists, and `auto` requires none: the console may make the first one."""
        t = gw.keys
        if t.mode != "auto" or not t.loaded or t.required:
            return False
        t.refresh()  # none seen here: is that still so (a key made a moment ago on another worker)?
        return not t.required

    def who() -> tuple[str, bool]:
        """Who acts (for the event), and whether this is the first key of a gateway with none."""
        if bootstrapping():
            return f"the console's first key (no key existed; from {request.remote_addr})", True
        admin = require_admin()
        return f"admin key {admin.name!r} ({admin.id})", False

    def fields(allowed: tuple[str, ...]) -> dict:
        body = request.get_json(silent=True)
        if not isinstance(body, dict):
            raise ApiError("bad_request", "expected a JSON object of the key's fields")
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            raise ApiError("bad_request", f"unknown field {unknown[0]!r}; the fields are {', '.join(allowed)}",
                           param=unknown[0])
        return body

    def applied(write, by_first: bool = False):
        """The store's write; ApiKeyInvalid 400, NotFound 404; a write that fell short of its replicas
        stands (NotReplicated), said in `warning`. This process applies the change at once."""
        warning = None
        try:
            value = write()
        except ApiKeyInvalid as e:
            raise ApiError("bad_request", str(e)) from None
        except NotFound as e:
            raise ApiError("not_found", str(e)) from None
        except NotReplicated as e:
            value, warning = e.value, str(e)
        gw.keys.refresh()  # the other gateways within LLMGW_GATEWAY_KEYS_INTERVAL
        return value, warning

    def note(models) -> str | None:
        unknown = unlisted_models(models or (), gw.store.catalog_names())
        return (f"{', '.join(unknown)} not in the applied catalog (yet); requests for it answer 404 until it is"
                if unknown else None)

    @bp.get("/api/keys")
    @api
    def keys_list():
        first = bootstrapping()
        if not first:
            require_admin()
        return {"keys": [_row(k) for k in gw.store.list_keys()], "fields": list(KEY_FIELDS), "bootstrap": first}

    @bp.post("/api/keys")
    @api
    def keys_create():
        by, first = who()
        body = fields(("name",) + KEY_FIELDS)
        name = body.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ApiError("bad_request", "name: required, the key's name (unique among the keys)", param="name")
        try:
            changes = key_changes(body, gw.clock.time())
        except ApiKeyInvalid as e:
            raise ApiError("bad_request", str(e)) from None
        if first:
            changes["admin"] = True  # else nobody could manage keys from here again
        rpm, tpm, priority = (changes.pop(f, None) for f in ("rpm", "tpm", "priority"))
        (kid, secret), warning = applied(lambda: gw.store.create_key(
            name.strip(), rpm, tpm, priority, now=gw.clock.time(), by=by, source="console", first=first, **changes))
        rec = next((k for k in gw.store.list_keys() if k.id == kid), None)
        return {"key": secret, "record": _row(rec) if rec else {"id": kid, "name": name},
                "note": note(changes.get("models")), "warning": warning}, 201

    @bp.patch("/api/keys/<name>")
    @api
    def keys_update(name: str):
        admin = require_admin()
        body = fields(KEY_FIELDS)
        try:
            changes = key_changes(body, gw.clock.time())
        except ApiKeyInvalid as e:
            raise ApiError("bad_request", str(e)) from None
        if not changes:
            raise ApiError("bad_request", f"nothing to change: give at least one of {', '.join(KEY_FIELDS)}")
        rec, warning = applied(lambda: gw.store.update_key(name, by=f"admin key {admin.name!r} ({admin.id})",
                                                           source="console", **changes))
        return {"record": _row(rec), "note": note(changes.get("models")), "warning": warning}

    @bp.delete("/api/keys/<name>")
    @api
    def keys_revoke(name: str):
        admin = require_admin()
        kid, warning = applied(lambda: gw.store.revoke_key(name, by=f"admin key {admin.name!r} ({admin.id})",
                                                           source="console"))
        return {"revoked": kid, "warning": warning}
