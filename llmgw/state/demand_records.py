"""What gateways report (their in-flight requests and queues per endpoint and model, a cold start's
demand hint, what they sent where and hold) and what the autoscaler decided from it. Plain dataclasses, as
`llmgw.state.records`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from llmgw.state.records import from_known


class GatewaySent(NamedTuple):
    """One request a gateway sent with prompt block keys (gateway.routing.prefixkeys): where, the keys,
    when (the sender's wall clock, seconds) and the prefill seconds it still needed there. The other
    gateways read it into their prefix index and prefill backlog (gateway.server.sendshare)."""

    endpoint: str
    keys: list[int]
    at: float
    prefill: float


class GatewayHolds(NamedTuple):
    """One gateway (`origin`) held `counts` requests per endpoint at `at` (its wall clock, seconds),
    its workers together. The other gateways count them as their sibling workers' (gateway.routing.othergateways)."""

    origin: str
    at: float
    counts: dict[str, int]


@dataclass(frozen=True)
class EndpointUse:
    """One gateway process's view of one endpoint: its requests in flight there now, and the wall
    clock of its last success and last failure to reach it (connection refused, reset or timed out).
    The failures and successes are the evidence the publisher weighs for a replica whose node agent
    is gone (docs/lifecycle.md)."""

    inflight: int = 0
    ok_at: float | None = None
    fail_at: float | None = None
    # Prefix-cache routing since the process started: (prompt tokens routed with block keys, of them
    # expected cached at this endpoint, prompt tokens of answers that said what they reused, of them
    # reused as the engine said: llama.cpp's timings.cache_n). None: nothing to say.
    prefix: tuple[float, float, float, float] | None = None


@dataclass(frozen=True)
class ModelDemand:
    """One gateway process's demand for one model: requests in flight, waiting in its queue (or for
    a cold start), and when the last one arrived (wall clock)."""

    inflight: int = 0
    queued: int = 0
    last_request_at: float | None = None


@dataclass(frozen=True)
class GatewayReport:
    """What one gateway process reports about itself, every fraction of a second, with a TTL: a
    dead gateway's report expires and stops counting. `version` is the endpoint list it routes by.
    `feeders`: of the requests in `endpoints`' counts, the batch lines of each batch feeder (by the id
    its lines carry, X-LLMGW-Feeder), counted at the same instant: how a feeder tells its own lines
    from the others' without assuming how long they took to get here (workers.batch.decide)."""

    id: str
    at: float
    version: int = 0
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    keys_loaded: bool = False
    endpoints: dict[str, EndpointUse] = field(default_factory=dict)
    models: dict[str, ModelDemand] = field(default_factory=dict)
    feeders: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        # Compact: a report is rewritten several times a second by every gateway process.
        d["endpoints"] = {k: [u.inflight, u.ok_at, u.fail_at, *([list(u.prefix)] if u.prefix else [])]
                          for k, u in self.endpoints.items()}
        d["models"] = {k: [m.inflight, m.queued, m.last_request_at] for k, m in self.models.items()}
        if not self.feeders:
            del d["feeders"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GatewayReport":
        d = dict(d)
        d["endpoints"] = {k: EndpointUse(*v[:3], tuple(v[3]) if len(v) > 3 and v[3] else None)
                          for k, v in (d.get("endpoints") or {}).items()}
        d["models"] = {k: ModelDemand(*v) for k, v in (d.get("models") or {}).items()}
        return from_known(cls, d)


@dataclass(frozen=True)
class DemandHint:
    """A gateway holds requests for a model that has no Ready replica (a cold start): written at once,
    with a short TTL, so the control plane need not wait for the next gateway report."""

    at: float
    queued: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DemandHint":
        return from_known(cls, d)


@dataclass(frozen=True)
class ScaleState:
    """The autoscaler's record of one profile: the replica count it wants (`count`, since `since`,
    because `reason`; `previous` before that), the latest pass (`decided_at`, `note`: its reason even
    when it held the count), and the latest evidence of work (`last_active`, for `idle_after`)."""

    count: int
    since: float
    reason: str = ""
    previous: int | None = None
    decided_at: float = 0.0
    last_active: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ScaleState":
        return from_known(cls, d)
