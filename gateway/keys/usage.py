"""Usage accounting and budgets, off the request path.

Usage (prompt/completion tokens and requests per key and model) is summed in memory and flushed to
Redis in one pipeline every LLMGW_GATEWAY_USAGE_FLUSH, kept across an outage and flushed when Redis
returns. The same flush adds each key's tokens to its budget period's counter and, in the same round
trip, reads back the counters of every key with a budget (what all gateways flushed). What a key has
spent, as this gateway knows it, is that total plus what it counted since: its own answers at once,
other gateways' within their flush and the next one here (`UsageRecorder.spent`).
"""

from __future__ import annotations

import threading
from collections import defaultdict

from gateway.observe.health import REDIS_ERRORS, RedisHealth
from llmgw.state.budget import Period
from llmgw.state.clock import Clock
from llmgw.state.store import Store


class UsageRecorder:
    """Sums usage in memory; `flush` writes it to Redis in one pipeline (kept on failure)."""

    MAX_PENDING = 100_000

    def __init__(self, store: Store, health: RedisHealth, clock: Clock):
        self.store, self.health, self.clock = store, health, clock
        self.lock = threading.Lock()
        # (key id, model) -> [prompt, completion, requests, requests with targets, of them met]
        self.usage: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
        self.tpm: dict[tuple[str, int], int] = defaultdict(int)
        # Budgets: tokens counted here that the last read of Redis did not hold yet, per (key id,
        # period id) -> [tokens, counter TTL] ...
        self.budget_pending: dict[tuple[str, str], list[int]] = {}
        # ... and per key id the period id and the tokens Redis held at the last flush (every gateway's).
        self.budget_seen: dict[str, tuple[str, int]] = {}

    def spent(self, key_id: str, period_id: str) -> int:
        """Tokens the key spent in the period, as this gateway knows now (no Redis)."""
        seen = self.budget_seen.get(key_id)
        pending = self.budget_pending.get((key_id, period_id))
        return (seen[1] if seen is not None and seen[0] == period_id else 0) + (pending[0] if pending else 0)

    def record(self, key_id: str, model: str, prompt: int, completion: int, limited: bool,
               budget: Period | None = None) -> None:
        with self.lock:
            if budget is not None and prompt + completion:
                b = self.budget_pending.setdefault((key_id, budget.id), [0, budget.counter_ttl])
                b[0] += prompt + completion
            if len(self.usage) > self.MAX_PENDING:
                return
            u = self.usage[(key_id, model)]
            u[0] += prompt
            u[1] += completion
            u[2] += 1
            if limited and prompt + completion:
                self.tpm[(key_id, int(self.clock.time() // 60))] += prompt + completion

    def targets(self, key_id: str, model: str, met: bool) -> None:
        """A request with latency targets ended (met them, or not: missed, refused early): `llmgw usage`
        shows each key's goodput on each model."""
        with self.lock:
            if len(self.usage) > self.MAX_PENDING:
                return
            u = self.usage[(key_id, model)]
            u[3] += 1
            u[4] += met

    def flush(self, read: list[tuple[str, str]] | None = None) -> None:
        """Write what was counted; `read`: the (key id, period id) budget counters to read back."""
        read = read or []
        with self.lock:
            usage, tpm = self.usage, self.tpm
            # Budget tokens stay counted here until the read that includes them is in.
            batch = {k: (n, ttl) for k, (n, ttl) in self.budget_pending.items()}
            if not usage and not tpm and not batch and not read:
                return
            self.usage, self.tpm = defaultdict(lambda: [0, 0, 0, 0, 0]), defaultdict(int)
        try:
            totals = self.store.add_usage(usage, tpm, batch, read)
            self.health.succeeded()
            with self.lock:
                for k, (n, _ttl) in batch.items():
                    left = self.budget_pending[k][0] - n
                    if left > 0:
                        self.budget_pending[k][0] = left
                    else:
                        del self.budget_pending[k]
                for (kid, period), total in zip(read, totals):
                    self.budget_seen[kid] = (period, total)
        except REDIS_ERRORS as e:
            self.health.failed(e)
            with self.lock:  # put it back for the next flush
                for k, counted in usage.items():  # prompt, completion, requests, with targets, met them
                    u = self.usage[k]
                    for i, n in enumerate(counted):
                        u[i] += n
                now_minute = int(self.clock.time() // 60)
                for k, n in tpm.items():
                    if k[1] >= now_minute - 1:
                        self.tpm[k] += n
