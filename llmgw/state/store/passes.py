"""Control pass counters: passes, seconds and actions per task, in one hash (`llmgw status`)."""

from __future__ import annotations

import redis

from llmgw.state import keys
from llmgw.state.store.base import Aggregate


class Passes(Aggregate):
    def count_pass(self, task: str, seconds: float, actions: int) -> None:
        """Count one pass of a control task (never raises: a counter must not fail a pass)."""
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.hincrby(keys.CONTROL_STATS, f"{task}:passes", 1)
            pipe.hincrbyfloat(keys.CONTROL_STATS, f"{task}:seconds", seconds)
            pipe.hincrby(keys.CONTROL_STATS, f"{task}:actions", actions)
            pipe.execute()
        except redis.RedisError:
            pass

    def control_stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.r.hgetall(keys.CONTROL_STATS).items()}
