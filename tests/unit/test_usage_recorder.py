"""gateway.keys.usage.UsageRecorder keeps what it counted when Redis is down, every counter of it."""

from __future__ import annotations

import redis

from gateway.keys.usage import UsageRecorder


class DownStore:
    def __init__(self):
        self.writes = []

    def add_usage(self, usage, tpm, batch, read):
        self.writes.append({k: list(v) for k, v in usage.items()})
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


class Health:
    def __init__(self):
        self.failures = 0

    def failed(self, e):
        self.failures += 1

    def succeeded(self):
        pass


class Clock:
    def time(self):
        return 1_000_000.0


def test_a_failed_flush_puts_back_tokens_requests_and_targets_met():
    store, health = DownStore(), Health()
    rec = UsageRecorder(store, health, Clock())
    rec.record("k1", "m", 10, 5, limited=False)
    rec.targets("k1", "m", met=True)
    rec.targets("k1", "m", met=False)
    rec.flush()  # Redis down: nothing lost, no exception out of the background loop
    assert health.failures == 1
    assert rec.usage[("k1", "m")] == [10, 5, 1, 2, 1]
    rec.record("k1", "m", 1, 1, limited=False)
    rec.flush()
    assert store.writes[-1] == {("k1", "m"): [11, 6, 2, 2, 1]}  # counted once each, across the outage
