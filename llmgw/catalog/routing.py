"""A model's `routing:` block in the catalog: how the gateway chooses among its replicas.

    routing:
      objective: first_token   # or completion; absent: from the request (streamed -> first_token)
      resume: true             # false: an answer whose engine breaks off is not moved to another replica

The gateway's cost of an endpoint is a request's expected completion, or its expected first token
(gateway.routing.choice). By default a streamed request minimises its first token (its client watches
tokens arrive) and a non-streamed one its completion (its client waits for the whole answer). On a
fleet of uneven speed the two differ: holding a request for a faster engine shortens its completion
and delays its first token. `objective` fixes one for every request of the model. Published on each
endpoint (EndpointInfo.objective) for the gateway to read.

`resume` (default true): when an engine breaks off an answer (dies, hangs, closes its stream), the
gateway continues it on another replica (gateway.http.resume); false ends such a stream with an
error event instead, and a whole answer with an error (EndpointInfo.resume).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictBool

OBJECTIVES = ("first_token", "completion")


class RoutingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    objective: Literal["first_token", "completion"] | None = None
    resume: StrictBool = True


def objective_reason(value) -> str:
    """The catalog error for a bad `routing.objective`."""
    return (f"unknown objective {value!r} (expected one of: {', '.join(OBJECTIVES)}; or leave it out to "
            "decide per request: streamed -> first_token)")
