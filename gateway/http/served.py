"""`GET /v1/llmgw/requests/{request id}`: how the gateway served a request that asked to be explained
(`X-LLMGW-Explain: 1`): the record of llmgw.state.served, its routing header read into fields, and
the sentences `llmgw explain REQUEST_ID` prints. The console's playground shows it beside each answer.

Who may read it: with keys in use, the key the request was sent with, or an admin key; any other
caller gets the 404 of a request with no record (so a request id tells nothing about another key's
traffic).
With no key required, anyone who reaches the gateway. The record is this process's own when it
served the request (at once), else Redis's once the serving process flushed it (within
LLMGW_GATEWAY_USAGE_FLUSH); 404 until then, and after SERVED_KEEP seconds.
"""

from __future__ import annotations

from flask import Flask, jsonify, request

from gateway.errors import ApiError
from gateway.observe.health import REDIS_ERRORS
from llmgw.state.served import SERVED_KEEP, recordable

REQUESTS_PATH = "/v1/llmgw/requests"


def register(app: Flask, gw) -> None:
    def story(rid: str):
        key = gw.gate.authenticate(request.environ)
        if key is not None:
            gw.gate.enforce(key, None)
        missing = ApiError("not_found", f"no record of request {rid!r}: a request is recorded when it sends "
                                        f"X-LLMGW-Explain: 1, readable once it ended and for {SERVED_KEEP // 60} "
                                        "minutes, by its own key or an admin key")
        if not recordable(rid):
            raise missing
        rec = gw.explained.get(rid)
        if rec is None:
            try:
                rec = gw.store.served(rid)
            except REDIS_ERRORS as e:
                raise ApiError("unavailable", f"the gateway cannot read Redis: {type(e).__name__}: {e}") from None
        if rec is None or (key is not None and not key.admin and rec.key_id != key.id):
            raise missing
        resp = jsonify(rec.view())
        resp.headers["Cache-Control"] = "no-store"
        return resp

    app.add_url_rule(REQUESTS_PATH + "/<rid>", "request_story", story)
