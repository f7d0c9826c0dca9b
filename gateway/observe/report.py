"""What one gateway process tells the control plane: a pure `gateway_report(...)` over a snapshot of
its tables (docs/lifecycle.md).

The report says which endpoint-list version the process routes by (the control plane waits for every
live gateway to have loaded a list without a stopping replica before it judges the drain), what it
has in flight per endpoint and per model, and its evidence about each endpoint: when it last got a
response head from it (`ok_at`) and when it last failed to reach it (`fail_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from llmgw.state.demand_records import EndpointUse, GatewayReport, ModelDemand

# Endpoints with nothing in flight are reported while their evidence is this recent (seconds).
EVIDENCE_WINDOW = 600.0


@dataclass(frozen=True)
class Identity:
    """Who reports: `id` is `host:pid`, unique per gateway process for as long as it lives."""

    id: str
    host: str
    pid: int
    started_at: float


def report_ttl(interval: float) -> float:
    """A report outlives a few missed writes, never a dead process by much."""
    return max(3.0, 6 * interval)


def gateway_report(
    who: Identity,
    now: float,
    version: int,
    keys_loaded: bool,
    inflight: Mapping[str, int],
    ok_at: Mapping[str, float],
    fail_at: Mapping[str, float],
    model_inflight: Mapping[str, int],
    queued: Mapping[str, int],
    last_request_at: Mapping[str, float],
    prefix: Mapping[str, tuple[float, float, float, float]] | None = None,  # gateway.routing.prefill.PrefixTally
    feeders: Mapping[str, int] | None = None,  # gateway.observe.feeders: batch lines by feeder, with `inflight`
) -> GatewayReport:
    """The report for this instant. Endpoints appear only when they have something to say: requests
    in flight, or a success or failure within EVIDENCE_WINDOW. Models appear once they were asked for
    (their names are bounded by the catalog: unknown names never get state)."""
    since = now - EVIDENCE_WINDOW
    endpoints = {}
    for eid in inflight.keys() | ok_at.keys() | fail_at.keys():
        n, ok, fail = inflight.get(eid, 0), ok_at.get(eid), fail_at.get(eid)
        if n > 0 or (ok is not None and ok >= since) or (fail is not None and fail >= since):
            endpoints[eid] = EndpointUse(n, ok, fail, prefix.get(eid) if prefix else None)
    models = {}
    for name in model_inflight.keys() | queued.keys() | last_request_at.keys():
        n, q, last = model_inflight.get(name, 0), queued.get(name, 0), last_request_at.get(name)
        if n > 0 or q > 0 or last is not None:
            models[name] = ModelDemand(n, q, last)
    return GatewayReport(id=who.id, at=now, version=version, host=who.host, pid=who.pid,
                         started_at=who.started_at, keys_loaded=keys_loaded, endpoints=endpoints,
                         models=models, feeders={k: n for k, n in (feeders or {}).items() if n > 0})
