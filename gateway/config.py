"""The gateway's knobs, read once from the environment (LLMGW_GATEWAY_*); see docs/gateway.md.

Redis comes from the shared `llmgw.config.Settings` (LLMGW_REDIS_URL / REDIS_URL). Bad values raise
`ConfigError(variable, reason)` at start-up, never later on the request path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

from llmgw.config import Settings
from llmgw.errors import ConfigError

POLICIES = ("llmgw", "round_robin", "least_inflight")
PRIORITIES = ("critical", "standard", "sheddable")
AUTH_MODES = ("auto", "required", "off")


@dataclass(frozen=True)
class RoutingConfig:
    """What `choose` and `admit` need; pure data so the unit tests build their own."""

    policy: str = "llmgw"
    # An endpoint is saturated when its engine reports this many waiting requests ...
    max_waiting: float = 5
    # ... or this KV-cache usage (0..1), or when the gateway's in-flight count reaches its capacity.
    max_kv: float = 0.8
    # LoadRecords older than this (seconds), or with ok=False, are ignored.
    stale_after: float = 3.0
    # Scores within this fraction of the best are near-ties, picked at random (spreads gateways).
    tie_tolerance: float = 0.05
    # Bounded-load affinity: a session sticks to its endpoint while that endpoint's load is at most
    # this factor times the mean load of its tier (plus one request).
    affinity_load_factor: float = 1.5
    # A standard request waits in the gateway for a full but faster endpoint only when the expected
    # completion by waiting, times this margin, still beats the best open endpoint (holding a request
    # costs its time to first token for certain; the gain is an estimate).
    wait_margin: float = 2.0
    # How much of the slowdown a request adds to the sequences already running on an endpoint counts
    # against sending it there (0: each request only minds its own completion; 1: the whole cost).
    imposed_weight: float = 1.0
    # How much KV-cache pressure stretches an endpoint's expected delay (delay * (1 + w * kv)).
    kv_weight: float = 0.5
    # A learned speed relaxes toward the fleet's best with this half-life (seconds) when the
    # endpoint gets no samples, so an endpoint that was slow once is tried again.
    forget_half_life: float = 60.0
    # The weight of a speed sample (scrape or answer) halves every this many seconds: how fast the
    # learned speed follows an engine that changes, against how much noise it averages out.
    learn_half_life: float = 10.0
    # An endpoint that refused a connection is passed over for this long (seconds) while its peers
    # can serve, instead of costing a retry on every request until the publisher drops it.
    eject_for: float = 5.0


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    routing: RoutingConfig = RoutingConfig()
    # LLMGW_GATEWAY_MAX_BODY_BYTES: larger request bodies get 413.
    max_body_bytes: int = 10 * 1024 * 1024
    # LLMGW_GATEWAY_CONNECT_TIMEOUT / _FIRST_BYTE_TIMEOUT / _TOTAL_TIMEOUT (seconds).
    connect_timeout: float = 2.0
    first_byte_timeout: float = 120.0
    total_timeout: float = 600.0
    # LLMGW_GATEWAY_RETRIES: further endpoints tried after a connect error / 5xx / 429 before any byte.
    retries: int = 2
    # LLMGW_GATEWAY_QUEUE_MAX / _QUEUE_TIMEOUT: the per-model queue standard requests wait in when
    # every endpoint is saturated. An LLM answer takes seconds, so a burst is absorbed by tens of
    # seconds of waiting (under a client's usual 60 s timeout), not refused; each waiting request
    # holds only its body. Requests the queue cannot serve within the bound are refused at once.
    queue_max: int = 1000
    queue_timeout: float = 30.0
    # LLMGW_GATEWAY_DEFAULT_PRIORITY: for requests without X-LLMGW-Priority and without a key default.
    default_priority: str = "standard"
    # LLMGW_GATEWAY_POLL_INTERVAL / _LOAD_INTERVAL / _KEYS_INTERVAL (seconds): background refreshes.
    poll_interval: float = 0.5
    load_interval: float = 0.5
    keys_interval: float = 2.0
    # LLMGW_GATEWAY_USAGE_FLUSH (seconds): usage counters are batched in memory and flushed this often.
    usage_flush: float = 0.5
    # LLMGW_GATEWAY_REDIS_TIMEOUT (seconds): socket timeout of the request-path Redis client.
    redis_timeout: float = 0.25
    # LLMGW_GATEWAY_SEED: seeds the router's randomness (benchmarks and tests); unset = random.
    seed: int | None = None
    # LLMGW_GATEWAY_UPSTREAM_POOL: keep-alive connections kept per endpoint.
    upstream_pool: int = 256
    # LLMGW_GATEWAY_AUTH: auto (a key is required once any key exists), required, off. Except with
    # off, nothing is served until the key table has been read from Redis once.
    auth: str = "auto"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "GatewayConfig":
        env = os.environ if env is None else env
        kw: dict = {"redis_url": Settings.from_env(env).redis_url}
        p = "LLMGW_GATEWAY_"

        def num(name: str, conv, lo=None, hi=None):
            raw = env.get(p + name)
            if raw is None or raw == "":
                return None
            try:
                v = conv(raw)
            except ValueError:
                raise ConfigError(p + name, f"expected a {conv.__name__}, got {raw!r}") from None
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                raise ConfigError(p + name, f"must be within [{lo}, {hi}], got {raw!r}")
            return v

        for name, conv, attr, lo, hi in (
            ("MAX_BODY_BYTES", int, "max_body_bytes", 1, None),
            ("CONNECT_TIMEOUT", float, "connect_timeout", 0.001, None),
            ("FIRST_BYTE_TIMEOUT", float, "first_byte_timeout", 0.001, None),
            ("TOTAL_TIMEOUT", float, "total_timeout", 0.001, None),
            ("RETRIES", int, "retries", 0, 10),
            ("QUEUE_MAX", int, "queue_max", 0, None),
            ("QUEUE_TIMEOUT", float, "queue_timeout", 0, None),
            ("POLL_INTERVAL", float, "poll_interval", 0.01, None),
            ("LOAD_INTERVAL", float, "load_interval", 0.01, None),
            ("KEYS_INTERVAL", float, "keys_interval", 0.01, None),
            ("USAGE_FLUSH", float, "usage_flush", 0.01, None),
            ("REDIS_TIMEOUT", float, "redis_timeout", 0.001, None),
            ("SEED", int, "seed", None, None),
            ("UPSTREAM_POOL", int, "upstream_pool", 1, None),
        ):
            v = num(name, conv, lo, hi)
            if v is not None:
                kw[attr] = v
        auth = env.get(p + "AUTH")
        if auth:
            if auth not in AUTH_MODES:
                raise ConfigError(p + "AUTH", f"expected one of {', '.join(AUTH_MODES)}, got {auth!r}")
            kw["auth"] = auth
        prio = env.get(p + "DEFAULT_PRIORITY")
        if prio:
            if prio not in PRIORITIES:
                raise ConfigError(p + "DEFAULT_PRIORITY", f"expected one of {', '.join(PRIORITIES)}, got {prio!r}")
            kw["default_priority"] = prio

        rkw: dict = {}
        policy = env.get(p + "POLICY")
        if policy:
            if policy not in POLICIES:
                raise ConfigError(p + "POLICY", f"expected one of {', '.join(POLICIES)}, got {policy!r}")
            rkw["policy"] = policy
        for name, attr, lo, hi in (
            ("MAX_WAITING", "max_waiting", 0, None),
            ("MAX_KV", "max_kv", 0, 1),
            ("STALE_AFTER", "stale_after", 0.01, None),
            ("TIE_TOLERANCE", "tie_tolerance", 0, 10),
            ("AFFINITY_LOAD_FACTOR", "affinity_load_factor", 1, None),
            ("KV_WEIGHT", "kv_weight", 0, None),
            ("WAIT_MARGIN", "wait_margin", 1, None),
            ("IMPOSED_WEIGHT", "imposed_weight", 0, None),
            ("FORGET_HALF_LIFE", "forget_half_life", 0.01, None),
            ("LEARN_HALF_LIFE", "learn_half_life", 0.01, None),
            ("EJECT_FOR", "eject_for", 0, None),
        ):
            v = num(name, float, lo, hi)
            if v is not None:
                rkw[attr] = v
        kw["routing"] = RoutingConfig(**rkw)
        return cls(**kw)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
