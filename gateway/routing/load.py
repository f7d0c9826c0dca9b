"""What an endpoint holds and can take, from its LoadRecord, our own count and what was learned. Pure.

`EndpointStats` is what routing reads about one endpoint besides its LoadRecord; the learner
(gateway.routing.learn) builds it, `choose` and the learner read it through the functions here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.config import RoutingConfig
from gateway.routing.speed import Speed
from llmgw.state.records import EndpointInfo, LoadRecord


@dataclass(frozen=True)
class EndpointStats:
    """What the gateway learned about one endpoint (part of the routing snapshot)."""

    speed: Speed | None = None  # learned from scrapes and answers; None: not yet
    last_sample: float = 0.0  # when `speed` last got a sample (the caller's monotonic clock)
    slots: int | None = None  # the engine's batch limit, as seen in a scrape while requests waited
    most_running: int = 0  # the most sequences a scrape saw it run at once (a floor under `slots`)
    scrape_inflight: int | None = None  # what we held when the current LoadRecord was scraped
    others_ratio: float = 0.0  # other gateways' requests per one of ours, over the model's endpoints
    # When this gateway first saw the current LoadRecord's `ts` (its own monotonic clock): staleness
    # is judged by it, never by comparing the agent's clock with ours.
    load_seen: float | None = None
    # Until when (the caller's monotonic clock) the endpoint is passed over: it refused a connection.
    down_until: float = 0.0
    # Prefill seconds per prompt token, from the engine's counters (gateway.routing.prefill); None: not yet.
    prefill: float | None = None
    prefill_since: LoadRecord | None = None  # the record the current span of prefill counters starts at
    # How far the engine kept what the gateway expected it to hold: reused / expected prompt tokens,
    # from the answers that said (gateway.routing.prefill.trust_of); 1 until they have said enough.
    prefix_trust: float = 1.0
    # The share of prompt tokens the engine served from its prefix cache lately (its counters, or its
    # answers' reuse), gateway.routing.prefill.reuse_seen: what the cached prompts a miss evicts there
    # are worth. None: not known yet (no charge).
    reuse: float | None = None


NO_STATS = EndpointStats()


def fresh_load(rec: LoadRecord | None, now: float, cfg: RoutingConfig, seen: float | None = None) -> LoadRecord | None:
    """The record if it can be trusted: scraped fine and recently; else None (unknown).

    `seen` is when this gateway first saw this record's `ts`, on the same clock as `now`; callers
    without it (tests on one clock) fall back to the record's own timestamp."""
    if rec is None or not rec.ok or now - (rec.ts if seen is None else seen) > cfg.stale_after:
        return None
    return rec


def ahead_of(ep: EndpointInfo, load: LoadRecord | None, inflight: int, st: EndpointStats | None) -> int:
    """Requests the endpoint holds: ours exactly, plus others' seen in the scrape. Other gateways (and
    gunicorn workers) route like this one on the same kind of traffic, so when we sent the endpoint
    more since it was scraped, they are taken to have done so too, in proportion to their share of
    the traffic: else each of them fills a fast endpoint past its capacity in the second before the
    next scrape shows what the others sent it meanwhile."""
    if load is None or (load.running is None and load.waiting is None):
        return inflight
    scraped = (load.running or 0) + (load.waiting or 0)
    if st is not None and st.scrape_inflight is not None:
        ours = st.scrape_inflight
        others = max(0.0, scraped - ours) + st.others_ratio * max(0, inflight - ours)
        return inflight + int(round(others))
    return max(inflight, int(round(scraped)))


def engine_saturated(load: LoadRecord | None, cfg: RoutingConfig) -> bool:
    """The engine itself says it is full: too many waiting, or the KV cache nearly used up."""
    if load is None:
        return False
    if load.waiting is not None and load.waiting >= cfg.max_waiting:
        return True
    return load.kv_usage is not None and load.kv_usage >= cfg.max_kv


def slots_of(ep: EndpointInfo, st: EndpointStats | None) -> float:
    """Sequences the endpoint runs at once: its capacity, or the batch limit its engine showed
    (whichever is lower); unbounded when neither is known."""
    cap, seen = ep.capacity, st.slots if st is not None else None
    if cap and seen:
        return float(min(cap, seen))
    return float(cap or seen or math.inf)
