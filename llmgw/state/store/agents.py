"""Node agents' wake-ups: a list per node that the launch and stop tasks push to, and the agent's
pass blocks on."""

from __future__ import annotations

from llmgw.state import keys
from llmgw.state.store.base import Aggregate


class Agents(Aggregate):
    def wake_agent(self, node: str, replica_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(keys.agent_wake(node), replica_id)
        pipe.ltrim(keys.agent_wake(node), -1000, -1)
        pipe.execute()

    def wait_for_wake(self, node: str, timeout: float) -> bool:
        """Block until a launch/stop task wakes `node`'s agent, or `timeout` seconds; every pending
        wake-up is taken at once, since one pass handles them all."""
        if self.r.blpop([keys.agent_wake(node)], timeout=timeout):
            self.r.delete(keys.agent_wake(node))
            return True
        return False
