"""The API key table, cached in memory and refreshed every LLMGW_GATEWAY_KEYS_INTERVAL, so checking a
key costs no Redis round trip; a revoked key stops working within one refresh. Whether a key is
required is `LLMGW_GATEWAY_AUTH` (auto | required | off); until the table has been read once (auto,
required) nothing is served, and during a Redis outage the cached table stays in use.
"""

from __future__ import annotations

import logging

from gateway.config import AUTH_MODES
from gateway.observe.health import REDIS_ERRORS, RedisHealth
from llmgw.state.keypolicy import ApiKeyRecord, hash_key, parse_table
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

    def find(self, name_or_id: str) -> ApiKey | None:
        return next((k for k in self.by_hash.values() if name_or_id in (k.id, k.name)), None)

    def budget_periods(self, now: float) -> list[tuple[str, str]]:
        """(key id, period id) of every key with a budget: the counters each usage flush reads."""
        return [(k.id, k.period(now).id) for k in list(self.by_hash.values()) if k.budget]  # type: ignore[union-attr]
