"""Per-key rate limits (requests and tokens per minute): fixed one-minute windows counted in Redis,
shared by every gateway; one pipelined round trip per request, only for keys that have a limit. While
Redis is down they fail open (requests are served, not counted).
"""

from __future__ import annotations

from gateway.keys.table import ApiKey
from gateway.observe.health import REDIS_ERRORS, RedisHealth
from llmgw.state.clock import Clock
from llmgw.state.store import Store


class RateLimiter:
    """Fixed per-minute windows in Redis. `check` returns seconds to wait, or None to go ahead."""

    def __init__(self, store: Store, health: RedisHealth, clock: Clock):
        self.store, self.health, self.clock = store, health, clock

    def check(self, key: ApiKey) -> tuple[str, int] | None:
        if not (key.rpm or key.tpm) or not self.health.ok:
            return None  # no limit, or Redis down: fail open
        now = self.clock.time()
        minute = int(now // 60)
        retry = max(1, int(60 - now % 60))
        try:
            requests, tokens = self.store.count_request(key.id, minute, bool(key.rpm), bool(key.tpm))
        except REDIS_ERRORS as e:
            self.health.failed(e)
            return None
        if key.rpm and requests > key.rpm:
            return f"{key.rpm} requests per minute", retry
        if key.tpm and tokens >= key.tpm:
            return f"{key.tpm} tokens per minute", retry
        return None
