"""Kick marks: per control task, `kick_dirty` (a fact arrived since its pass started) and
`kick_scheduled` (a task is on its way), each with a TTL. The rule over them is `llmgw.state.kicks`."""

from __future__ import annotations

from llmgw.state import keys
from llmgw.state.store.base import Aggregate, ms


class Kicks(Aggregate):
    def mark_kicked(self, task: str, dirty_ttl: float, scheduled_ttl: float) -> bool:
        """Mark `task` dirty and claim sending it (SET NX); True if this call claimed it."""
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keys.kick_dirty(task), "1", px=ms(dirty_ttl))
        pipe.set(keys.kick_scheduled(task), "1", nx=True, px=ms(scheduled_ttl))
        _, scheduled = pipe.execute()
        return bool(scheduled)

    def clear_kick_marks(self, task: str) -> None:
        self.r.delete(keys.kick_dirty(task), keys.kick_scheduled(task))

    def kick_dirty(self, task: str) -> bool:
        return bool(self.r.exists(keys.kick_dirty(task)))

    def mark_kick_dirty(self, task: str, ttl: float) -> None:
        self.r.set(keys.kick_dirty(task), "1", px=ms(ttl))
