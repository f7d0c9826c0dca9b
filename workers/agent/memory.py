"""What the node agent remembers between passes, beside the records in Redis: each replica's current
attempt and its launch once known (`Local`), the facts of this node's multi-node member parts (never
written to Redis: only the head writes the record's agent fields), and when SIGTERM went to an
engine without a record. The pass reads and updates it; `supervisor.remember` says how an action
changes an attempt's memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet

from workers.agent import supervisor as sv
from workers.agent.launch import Launch


@dataclass
class Local:
    """This agent's memory of one replica's current attempt, and its launch once known."""

    memory: sv.Attempt
    launch: Launch | None = None


@dataclass
class Memory:
    local: dict[str, Local] = field(default_factory=dict)
    members: dict[str, dict] = field(default_factory=dict)  # facts of multi-node member parts (never in Redis)
    orphan_terms: dict[str, float] = field(default_factory=dict)  # when SIGTERM went to an attempt without a record

    def forget_except(self, ids: AbstractSet[str]) -> None:
        """Drop what is remembered of replicas whose record is gone."""
        for memory in (self.local, self.members):
            for rid in [k for k in memory if k not in ids]:
                del memory[rid]

    def attempts(self) -> dict[str, sv.Attempt]:
        return {rid: loc.memory for rid, loc in self.local.items()}

    def health_paths(self) -> dict[str, str]:
        return {rid: loc.launch.spec.health_path for rid, loc in self.local.items() if loc.launch}

    def launches(self) -> dict[str, Launch | None]:
        return {rid: loc.launch for rid, loc in self.local.items()}

    def launch(self, rid: str) -> Launch | None:
        loc = self.local.get(rid)
        return loc.launch if loc else None

    def remember(self, action: sv.Action, now: float) -> None:
        """The attempt's memory after `action` (`supervisor.remember`); forgotten when it is over."""
        loc = self.local.get(action.replica_id)
        memory = sv.remember(loc.memory if loc else None, action, now)
        if memory is None:
            self.local.pop(action.replica_id, None)
        elif loc is not None:
            loc.memory = memory
