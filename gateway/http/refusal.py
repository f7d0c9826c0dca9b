"""How a refused or failed proxied request is worded: pure functions from the routing and admission
outcomes to the `ApiError` the client gets (its kind, message and Retry-After). The one place to
change what a refusal says.
"""

from __future__ import annotations

from gateway.errors import ApiError
from gateway.keys.policy import unknown_model
from gateway.routing.adapters import NO_ADAPTER
from gateway.routing.admission import ADAPTER_LOAD, COLD_START, RESTART, RESUMING, Refuse, Shed, TimedOut, retry_after
from gateway.routing.choice import Rejection, RouteRequest
from gateway.routing.retry import GiveUp, Outcome
from gateway.routing.tables import Tables
from llmgw import surface as op


def refusal(why: Rejection | Shed | TimedOut, req: RouteRequest, tables: Tables, *,
            last_error: ApiError | None = None, cold_start: float | None = None,
            adapter_load: float | None = None) -> ApiError:
    """The answer to a request routing or admission turned away. `cold_start`: the model's
    cold-start timeout when the request was held for one; `adapter_load`: how long a request for a
    LoRA adapter no replica holds waits for one to load it; `last_error`: the failure of its last
    attempt, when every endpoint failed it."""
    model = req.model
    if adapter_load is not None:
        if isinstance(why, Shed):
            return ApiError("shed", f"adapter {model!r} is being loaded: {why.reason}", why.retry_after)
        if isinstance(why, TimedOut):
            return ApiError("no_replica", f"adapter {model!r} was not loaded on any replica within "
                            f"{adapter_load:g}s; retry shortly", retry_after(adapter_load))
        if why.kind == NO_ADAPTER:
            return ApiError("no_replica", f"adapter {model!r} cannot be served now: {why.detail}", 5)
    if isinstance(why, Shed):
        doing = "starting" if cold_start is not None else "saturated"
        return ApiError("shed", f"model {model!r} is {doing}: {why.reason}", why.retry_after)
    if isinstance(why, TimedOut):
        if cold_start is not None:
            return ApiError("no_replica", f"model {model!r} is starting (scaling up from zero): no replica was "
                            f"Ready within {cold_start:g}s; retry shortly", retry_after(cold_start))
        return ApiError("shed", f"model {model!r} is saturated; try again later", max(1, int(why.seconds)))
    if why.kind == "no_ready" and last_error is not None:
        return last_error
    if why.kind == "unknown_model" and model not in tables.known_models:
        return ApiError("model_not_found", unknown_model(model))
    if why.kind == "unsupported":
        method, path = op.OPERATIONS[req.op]
        who = f"endpoint {req.pin}" if req.pin else f"no endpoint of model {model!r}"
        return ApiError("unsupported", f"{who} serves {method} {path}: {why.detail}; {serving(tables, req.op)}")
    keyless = sorted({var for eid, var in tables.missing_keys.items() if model in tables.by_id[eid].models})
    if keyless:
        return ApiError("no_replica", f"no Ready endpoint for model {model!r} this gateway can send to: "
                        f"the API key variable(s) {', '.join(keyless)} are not set in its environment", 1)
    return ApiError("no_replica", f"no Ready endpoint for model {model!r}")


def refused(step: Refuse, req: RouteRequest, tables: Tables, last_error: ApiError | None = None) -> ApiError:
    """The answer to admission's `Refuse`."""
    if step.during == RESUMING and isinstance(step.error, TimedOut):
        return ApiError("no_replica", f"no replica of model {req.model!r} took the rest of the answer within "
                        f"{step.hold:g}s", 1)
    if step.during == RESTART:
        model = req.model
        if isinstance(step.error, Shed):
            return ApiError("shed", f"model {model!r} has no replica it can reach now: {step.error.reason}",
                            step.error.retry_after)
        if isinstance(step.error, TimedOut):
            return ApiError("no_replica", f"no replica of model {model!r} could be reached, and none came back "
                            f"within {step.hold:g}s (LLMGW_GATEWAY_RESTART_HOLD); retry shortly",
                            retry_after(step.hold or 0.0))
    return refusal(step.error, req, tables, last_error=last_error,
                   cold_start=step.hold if step.during == COLD_START else None,
                   adapter_load=step.hold if step.during == ADAPTER_LOAD else None)


def serving(tables: Tables, operation: str) -> str:
    """Which models' Ready endpoints serve `operation`, for the refusal of a model whose do not."""
    models = sorted({e.model or e.models[0] for e in tables.endpoints if e.serves(operation)})
    if not models:
        return "no model here serves it now"
    shown = ", ".join(models[:10]) + (f" and {len(models) - 10} more" if len(models) > 10 else "")
    return f"model{'s' if len(models) > 1 else ''} that serve{'' if len(models) > 1 else 's'} it: {shown}"


def attempt_failed(outcome: Outcome, endpoint_id: str, model: str, first_byte_timeout: float,
                   give_up: GiveUp | None = None) -> ApiError:
    """The error of an attempt that failed before any byte reached the client: the answer when
    `give_up` says so, else what the request ends with if no other endpoint serves it."""
    if give_up is not None and give_up.kind == "upstream_timeout":
        return ApiError("upstream_timeout", f"endpoint {endpoint_id} sent nothing within {first_byte_timeout}s")
    if give_up is not None or outcome.kind == "connect_error":
        return ApiError("no_replica", f"no endpoint of model {model!r} could be reached")
    return ApiError("upstream_error", f"endpoint {endpoint_id} answered {outcome.status}")


def unready(keys_ready: bool, list_loaded: bool, redis_error: str | None, started: bool) -> str | None:
    """Why a process cannot serve yet (None: it can), for /readyz and its 503s."""
    why = (f" (Redis unavailable: {redis_error})" if redis_error is not None
           else "" if started else " (this process never started its background loops: serve "
           "it with `gunicorn -c python:gateway.gunicorn_conf`)")
    if not keys_ready:
        return f"the gateway has not loaded its API keys yet{why}; retry shortly"
    if not list_loaded:
        return f"the gateway has not loaded the endpoint list yet{why}"
    return None


def not_loaded(reason: str | None) -> ApiError:
    """A request before this process has loaded the endpoint list."""
    return ApiError("no_replica", reason or "the gateway has not loaded the endpoint list yet", 1)
