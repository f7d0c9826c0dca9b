"""API keys, per-key rate limits and usage accounting.

- Keys: the whole key table (a small hash) is cached in memory and refreshed every ~2 s, so checking
  a key costs no Redis round trip; a revoked key stops working within one refresh. Whether a key is
  required is `LLMGW_GATEWAY_AUTH` (auto | required | off); until the table has been read once
  (auto, required) nothing is served, and during a Redis outage the cached table stays in use.
- Rate limits (requests/min, tokens/min): fixed one-minute windows counted in Redis, shared by every
  gateway; one pipelined round trip per request, only for keys that have a limit. While Redis is down
  they fail open (requests are served, not counted).
- Usage (prompt/completion tokens and requests per key and model) is summed in memory and flushed to
  Redis in one pipeline every ~0.5 s, off the request path; it is kept across an outage and flushed
  when Redis returns.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from gateway.config import AUTH_MODES
from gateway.state import REDIS_ERRORS, RedisHealth
from llmgw.state.apikeys import ApiKeyRecord, hash_key, parse_table
from llmgw.state.clock import Clock
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

ApiKey = ApiKeyRecord  # the gateway's name for the shared record type


class KeyTable:
    """The cached key table and the auth mode.

    `auto` requires a key once this process has seen any key record, and keeps requiring one even if
    the table later reads empty: an empty hash after Redis restarted without its data must not open
    the gateway (revoking the last key therefore leaves it closed; set `off` to open it)."""

    def __init__(self, store: Store, health: RedisHealth, mode: str = "auto"):
        if mode not in AUTH_MODES:
            raise ValueError(f"auth mode must be one of {AUTH_MODES}, got {mode!r}")
        self.store = store
        self.health = health
        self.mode = mode
        self.by_hash: dict[str, ApiKey] = {}
        self.loaded = False
        self.seen_keys = False
        self._problems: list[str] = []

    @property
    def required(self) -> bool:
        return self.mode == "required" or (self.mode == "auto" and self.seen_keys)

    @property
    def ready(self) -> bool:
        """Whether requests may be served: `off`, or the table has been read at least once."""
        return self.mode == "off" or self.loaded

    def refresh(self) -> None:
        """Re-read the table; on a Redis error keep the cached one (static stability)."""
        try:
            raw = self.store.api_key_table()
        except REDIS_ERRORS as e:
            self.health.failed(e)
            return
        recs, problems = parse_table(raw)
        if problems != self._problems:  # once per change, not every refresh
            for p in problems:
                log.error("ignoring malformed %s", p)
            self._problems = problems
        table = {k.hash: k for k in recs}
        self.by_hash, self.loaded = table, True
        if raw:
            self.seen_keys = True

    def lookup(self, presented: str | None) -> ApiKey | None:
        if not presented:
            return None
        return self.by_hash.get(hash_key(presented))


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


class UsageRecorder:
    """Sums usage in memory; `flush` writes it to Redis in one pipeline (kept on failure)."""

    MAX_PENDING = 100_000

    def __init__(self, store: Store, health: RedisHealth, clock: Clock):
        self.store, self.health, self.clock = store, health, clock
        self.lock = threading.Lock()
        self.usage: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        self.tpm: dict[tuple[str, int], int] = defaultdict(int)

    def record(self, key_id: str, model: str, prompt: int, completion: int, limited: bool) -> None:
        with self.lock:
            if len(self.usage) > self.MAX_PENDING:
                return
            u = self.usage[(key_id, model)]
            u[0] += prompt
            u[1] += completion
            u[2] += 1
            if limited and prompt + completion:
                self.tpm[(key_id, int(self.clock.time() // 60))] += prompt + completion

    def flush(self) -> None:
        with self.lock:
            usage, tpm = self.usage, self.tpm
            if not usage and not tpm:
                return
            self.usage, self.tpm = defaultdict(lambda: [0, 0, 0]), defaultdict(int)
        try:
            self.store.add_usage(usage, tpm)
            self.health.succeeded()
        except REDIS_ERRORS as e:
            self.health.failed(e)
            with self.lock:  # put it back for the next flush
                for k, (p, c, n) in usage.items():
                    u = self.usage[k]
                    u[0] += p
                    u[1] += c
                    u[2] += n
                now_minute = int(self.clock.time() // 60)
                for k, n in tpm.items():
                    if k[1] >= now_minute - 1:
                        self.tpm[k] += n
