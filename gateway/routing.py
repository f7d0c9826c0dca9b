"""Where a request goes: a pure `choose(endpoints, loads, inflight, request, now) -> Choice | Rejection`.

The load-aware policy (`llmgw`) is shortest expected delay over a multi-slot queue: an endpoint with
`slots` concurrent sequences and a learned per-request service time `unit` finishes a request sent
now after about `unit * max(1, (ahead + 1) / slots)`, where `ahead` is what it already holds (the
gateway's own in-flight count, exact and immediate, plus what other gateways sent as seen in the last
scrape). Below its slots a batch engine's latency stays flat, so a fast endpoint with free slots beats
an idle slow one, and a slow one only takes overflow once the fast ones queue deeply. Scores within
`tie_tolerance` of the best are picked at random, so many gateways do not herd onto one endpoint.

Priority tiers: the highest tier that has an unsaturated endpoint takes the request. A request with
an affinity key (session) goes to its rendezvous-hash endpoint while that one is not overloaded.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Mapping, Sequence

from gateway.config import RoutingConfig
from llmgw.state.records import EndpointInfo, LoadRecord
from llmgw.surface import CHAT


@dataclass(frozen=True)
class RouteRequest:
    model: str
    priority: str = "standard"  # critical | standard | sheddable (only `critical` matters here)
    affinity: str | None = None  # X-Session-ID or OpenAI `user`
    exclude: frozenset[str] = frozenset()  # endpoints already tried for this request (retries)
    queued: int = 1  # requests of this model waiting in the gateway, this one included
    op: str = CHAT  # the operation (llmgw.surface): only endpoints that serve it are candidates
    pin: str | None = None  # the one endpoint it may go to (a response's, by its id)


@dataclass(frozen=True)
class EndpointStats:
    """What the gateway learned about one endpoint (kept by gateway.state, passed in as a snapshot)."""

    unit: float | None = None  # smoothed service time of one request at or below its slots (s)
    last_sample: float = 0.0  # when `unit` was last updated (the caller's monotonic clock)
    scrape_inflight: int | None = None  # our in-flight count when the current LoadRecord was read
    scrape_unit: float | None = None  # service time implied by the engine's token throughput (scrapes)
    # When this gateway first saw the current LoadRecord's `ts` (its own monotonic clock): staleness
    # is judged by it, never by comparing the agent's clock with ours.
    load_seen: float | None = None
    # Until when (the caller's monotonic clock) the endpoint is passed over: it refused a connection.
    down_until: float = 0.0


@dataclass(frozen=True)
class Choice:
    endpoint: EndpointInfo
    score: float
    ahead: int  # requests the endpoint holds before this one (for learning the service time)
    saturated: bool = False  # True when sent past saturation (critical traffic)
    reason: str = ""


@dataclass(frozen=True)
class Rejection:
    kind: str  # "unknown_model" | "unsupported" | "no_ready" | "saturated"
    model: str
    detail: str = ""


@dataclass(frozen=True)
class _Cand:
    ep: EndpointInfo
    ahead: int
    saturated: bool
    score: float
    soft: bool = False  # saturated only by what it holds reaching capacity (not by the engine)
    unit: float = 1.0


def fresh_load(rec: LoadRecord | None, now: float, cfg: RoutingConfig, seen: float | None = None) -> LoadRecord | None:
    """The record if it can be trusted: scraped fine and recently; else None (unknown).

    `seen` is when this gateway first saw this record's `ts`, on the same clock as `now`; callers
    without it (tests on one clock) fall back to the record's own timestamp."""
    if rec is None or not rec.ok or now - (rec.ts if seen is None else seen) > cfg.stale_after:
        return None
    return rec


def _ahead(ep: EndpointInfo, load: LoadRecord | None, inflight: int, st: EndpointStats | None) -> int:
    """Requests the endpoint holds: ours exactly, plus others' seen in the scrape."""
    if load is None or (load.running is None and load.waiting is None):
        return inflight
    scraped = (load.running or 0) + (load.waiting or 0)
    if st is not None and st.scrape_inflight is not None:
        others = max(0.0, scraped - st.scrape_inflight)  # what other gateways (or clients) sent
        return inflight + int(round(others))
    return max(inflight, int(round(scraped)))


def engine_saturated(load: LoadRecord | None, cfg: RoutingConfig) -> bool:
    """The engine itself says it is full: too many waiting, or the KV cache nearly used up."""
    if load is None:
        return False
    if load.waiting is not None and load.waiting >= cfg.max_waiting:
        return True
    return load.kv_usage is not None and load.kv_usage >= cfg.max_kv


def effective_unit(st: EndpointStats | None, best: float | None, now: float, cfg: RoutingConfig) -> float | None:
    """The learned service time, relaxed toward the fleet's best while the endpoint gets no samples."""
    if st is None or st.unit is None:
        if st is not None and st.scrape_unit is not None:
            return st.scrape_unit  # never served by us, but its engine's throughput tells its speed
        return best  # unknown endpoints are assumed as good as the best: they get explored
    if best is None or st.unit <= best:
        return st.unit
    age = max(0.0, now - st.last_sample)
    return best + (st.unit - best) * 0.5 ** (age / cfg.forget_half_life)


def expected_delay(unit: float, ahead: float, slots: int, weight: float, kv: float | None, cfg: RoutingConfig) -> float:
    """Seconds until a request sent now completes; the small linear term prefers the emptier of two
    endpoints that both still have free slots."""
    depth = (ahead + 1) / max(1, slots)
    delay = unit * (max(1.0, depth) + 0.1 * depth)
    if kv:
        delay *= 1.0 + cfg.kv_weight * kv
    return delay / max(weight, 1e-6)


def _rendezvous(key: str, ep_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{ep_id}".encode(), digest_size=8).digest(), "big")


def choose(
    endpoints: Sequence[EndpointInfo],
    loads: Mapping[str, LoadRecord],
    inflight: Mapping[str, int],
    request: RouteRequest,
    now: float,
    *,
    stats: Mapping[str, EndpointStats] | None = None,
    cfg: RoutingConfig = RoutingConfig(),
    rng: random.Random,
    rr_counter: int = 0,
) -> Choice | Rejection:
    """Pick an endpoint for `request`, or say why none: unknown model, no endpoint serving the
    operation, none Ready, all saturated.

    `critical` requests are never rejected for saturation: they go to the least-loaded endpoint.
    `now` is the caller's monotonic clock (LoadRecord freshness via `stats[...].load_seen`, learned
    speeds via `last_sample`); `rng` is always the caller's, so a seed reproduces every choice."""
    stats = stats or {}
    serving = [e for e in endpoints if request.model in e.models
               and (request.pin is None or e.id == request.pin)]
    if not serving:
        return Rejection("unknown_model", request.model)
    able = [e for e in serving if e.serves(request.op)]
    if not able:
        engines = ", ".join(sorted({e.engine for e in serving}))
        return Rejection("unsupported", request.model, f"its endpoints ({engines}) do not serve it")
    tried = [e for e in able if e.id not in request.exclude]
    if not tried:
        return Rejection("no_ready", request.model, "every endpoint failed for this request")
    # Endpoints that refused a connection a moment ago are passed over while any other can serve
    # (when all of them did, trying one is still better than refusing the request).
    up = [e for e in tried if (s := stats.get(e.id)) is None or s.down_until <= now]
    tried = up or tried

    known = [s.unit for e in tried if (s := stats.get(e.id)) is not None and s.unit is not None]
    best = min(known) if known else None
    cands: list[_Cand] = []
    for e in tried:
        n = inflight.get(e.id, 0)
        st = stats.get(e.id)
        load = fresh_load(loads.get(e.id), now, cfg, st.load_seen if st is not None else None)
        ahead = _ahead(e, load, n, st)
        hard = engine_saturated(load, cfg)
        # Capacity counts what the endpoint holds from everyone (other gateways and gunicorn workers
        # as seen in the scrape, ours exactly), not just this process's in-flight requests.
        soft = bool(e.capacity and ahead >= e.capacity)
        if best is not None and (st is None or (st.unit is None and st.scrape_unit is None)) and n >= 1:
            soft = True  # unknown speed while others are known: one probe at a time until it is learned
        unit = effective_unit(st, best, now, cfg) or 1.0
        kv = load.kv_usage if load is not None else None
        score = expected_delay(unit, ahead, e.capacity or 1, e.weight, kv, cfg)
        cands.append(_Cand(e, ahead, hard or soft, score, soft and not hard, unit))

    # The benchmark baselines behave like the peers' routers: no saturation, no admission.
    if cfg.policy == "round_robin":
        cands.sort(key=lambda c: c.ep.id)
        c = cands[rr_counter % len(cands)]
        return Choice(c.ep, c.score, c.ahead, c.saturated, "round_robin")
    if cfg.policy == "least_inflight":
        low = min(c.ahead for c in cands)
        c = rng.choice([c for c in cands if c.ahead == low])
        return Choice(c.ep, c.score, c.ahead, c.saturated, "least_inflight")

    # Highest priority tier with room takes the request; lower tiers take the overflow.
    for prio in sorted({c.ep.priority for c in cands}, reverse=True):
        tier = [c for c in cands if c.ep.priority == prio]
        open_ = [c for c in tier if not c.saturated]
        if not open_:
            continue
        if request.priority == "standard" and _better_to_wait(tier, open_, request, cfg):
            return Rejection("saturated", request.model, "deferred: a faster endpoint frees sooner")
        return _pick(open_, request, rng, cfg, "tier %d" % prio)
    if request.priority == "critical":
        best_c = min(cands, key=lambda c: c.score)
        return Choice(best_c.ep, best_c.score, best_c.ahead, True, "critical past saturation")
    return Rejection("saturated", request.model, f"all {len(cands)} endpoints saturated")


def _better_to_wait(tier: list[_Cand], open_: list[_Cand], request: RouteRequest, cfg: RoutingConfig) -> bool:
    """Waiting in the gateway's queue for a full (by capacity) but fast endpoint beats sending to the
    best open one: count the queued requests as extra load on the full endpoints, so a growing queue
    overflows to the slower endpoints instead of waiting on the fast ones forever."""
    full = [c for c in tier if c.soft]
    if not full:
        return False
    share = max(1, request.queued) / len(full)
    wait = min(expected_delay(c.unit, c.ahead + share, c.ep.capacity or 1, c.ep.weight, None, cfg)
               for c in full)
    return wait * cfg.wait_margin < min(c.score for c in open_)


def _pick(tier: list[_Cand], request: RouteRequest, rng: random.Random, cfg: RoutingConfig, why: str) -> Choice:
    if request.affinity:
        mean = sum(c.ahead for c in tier) / len(tier)
        bound = cfg.affinity_load_factor * mean + 1
        for c in sorted(tier, key=lambda c: _rendezvous(request.affinity, c.ep.id), reverse=True):
            if c.ahead <= bound:
                return Choice(c.ep, c.score, c.ahead, False, why + ", affinity")
    low = min(c.score for c in tier)
    near = [c for c in tier if c.score <= low * (1 + cfg.tie_tolerance)]
    c = near[0] if len(near) == 1 else rng.choice(near)
    return Choice(c.ep, c.score, c.ahead, False, why)
