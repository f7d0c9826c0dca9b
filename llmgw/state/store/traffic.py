"""Gateway traffic: per time slot, a hash of counters every gateway process adds to (the console's
charts)."""

from __future__ import annotations

from typing import Iterable, Mapping

from llmgw.state import keys
from llmgw.state.store.base import Aggregate


class Traffic(Aggregate):
    def add_traffic(self, counts: Mapping[int, Mapping[str, int]], ttl: float) -> None:
        """Add one gateway process's counts to each slot's hash, in one pipeline."""
        pipe = self.r.pipeline(transaction=False)
        for slot, fields in counts.items():
            key = keys.traffic(slot)
            for name, n in fields.items():
                pipe.hincrby(key, name, n)
            pipe.expire(key, int(ttl))
        pipe.execute()

    def traffic(self, slots: Iterable[int]) -> dict[int, dict[str, str]]:
        slots = list(slots)
        pipe = self.r.pipeline(transaction=False)
        for s in slots:
            pipe.hgetall(keys.traffic(s))
        return dict(zip(slots, pipe.execute()))
