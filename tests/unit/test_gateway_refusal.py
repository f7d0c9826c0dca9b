"""How a refused or failed request is worded (gateway.http.refusal): one pure table from the routing
and admission outcomes to the client's error."""

import pytest

from gateway.errors import ApiError
from gateway.http.refusal import TimedOut, attempt_failed, not_loaded, refusal, unready
from gateway.routing.admission import Shed
from gateway.routing.choice import Rejection, RouteRequest
from gateway.routing.retry import GiveUp, Outcome
from gateway.routing.tables import tables_from
from llmgw import surface as op
from llmgw.state.records import EndpointInfo


class Names:
    canonical = {"m": "m", "cat": "cat"}
    groups = [("m",), ("cat",)]
    cold_start: dict = {}


TABLES = tables_from(1, "fp", [
    EndpointInfo(id="e1", url="http://e1", models=("m",), engine="sim", model="m"),
    EndpointInfo(id="x1", url="http://x1", models=("ext",), engine="external", model="ext", api_key_env="EXT_KEY"),
], Names(), {})


def said(err: ApiError) -> tuple:
    return err.kind, err.status, err.message, err.retry_after


@pytest.mark.parametrize("why, req, kw, want", [
    (Shed("model saturated and its queue is full", 30), RouteRequest("m"), {},
     ("shed", 429, "model 'm' is saturated: model saturated and its queue is full", 30)),
    (Shed("the model is starting and 4 requests already wait for it", 2), RouteRequest("m"), {"cold_start": 9.0},
     ("shed", 429, "model 'm' is starting: the model is starting and 4 requests already wait for it", 2)),
    (TimedOut(30.0), RouteRequest("m"), {}, ("shed", 429, "model 'm' is saturated; try again later", 30)),
    (TimedOut(9.0), RouteRequest("m"), {"cold_start": 9.0},
     ("no_replica", 503, "model 'm' is starting (scaling up from zero): no replica was Ready within 9s; "
      "retry shortly", 2)),
    (Rejection("unknown_model", "nope"), RouteRequest("nope"), {},
     ("model_not_found", 404, "model 'nope' does not exist", None)),
    (Rejection("unknown_model", "cat"), RouteRequest("cat"), {},  # in the catalog, not published
     ("no_replica", 503, "no Ready endpoint for model 'cat'", None)),
    (Rejection("unsupported", "m", "its endpoints (sim) do not serve it"), RouteRequest("m", op=op.RERANK), {},
     ("unsupported", 400, "no endpoint of model 'm' serves POST /v1/rerank: its endpoints (sim) do not serve it; "
      "no model here serves it now", None)),
    # ... and names the models that do (e1 was published without a path map: chat, completions, embeddings).
    (Rejection("unsupported", "cat", "its endpoints (vllm) do not serve it"), RouteRequest("cat", op=op.EMBEDDINGS), {},
     ("unsupported", 400, "no endpoint of model 'cat' serves POST /v1/embeddings: its endpoints (vllm) do not serve "
      "it; model that serves it: m", None)),
    (Rejection("unknown_model", "ext"), RouteRequest("ext"), {},
     ("no_replica", 503, "no Ready endpoint for model 'ext' this gateway can send to: the API key variable(s) "
      "EXT_KEY are not set in its environment", 1)),
    (Rejection("no_ready", "m"), RouteRequest("m"), {"last_error": ApiError("upstream_error", "endpoint e1 answered 502")},
     ("upstream_error", 502, "endpoint e1 answered 502", None)),
])
def test_each_refusal_has_one_wording(why, req, kw, want):
    assert said(refusal(why, req, TABLES, **kw)) == want


def test_failed_attempts_and_an_unloaded_list():
    assert said(attempt_failed(Outcome("timeout"), "e1", "m", 120.0, GiveUp("upstream_timeout"))) == \
        ("upstream_timeout", 504, "endpoint e1 sent nothing within 120.0s", None)
    assert said(attempt_failed(Outcome("connect_error"), "e1", "m", 120.0, GiveUp("no_replica"))) == \
        ("no_replica", 503, "no endpoint of model 'm' could be reached", None)
    assert said(attempt_failed(Outcome("answer", 503), "e1", "m", 120.0)) == \
        ("upstream_error", 502, "endpoint e1 answered 503", None)
    assert said(not_loaded(None)) == ("no_replica", 503, "the gateway has not loaded the endpoint list yet", 1)


def test_why_a_process_is_not_ready():
    assert "API keys" in unready(False, False, None, True) and "retry shortly" in unready(False, True, None, True)
    assert unready(True, False, "ConnectionError: refused", True) == \
        "the gateway has not loaded the endpoint list yet (Redis unavailable: ConnectionError: refused)"
    assert "gunicorn_conf" in unready(True, False, None, False)  # says how it should be served
    assert unready(True, True, None, True) is None
