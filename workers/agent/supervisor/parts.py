"""Multi-node replicas on the agent's side: the head (the record's `node`) writes the record's agent
fields; a member part keeps its own facts in its agent's memory, follows the head's attempt (it
joins only a running one, and leaves and rejoins when the head's attempt changes), and each node
confirms its own part's stop."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from llmgw.state.keys import replica_stopped_on
from llmgw.state.records import AGENT_FIELDS, ReplicaRecord
from workers.agent.supervisor.actions import Action, Rejoin, Signal
from workers.agent.supervisor.observed import ExitFacts, Found, Observed
from workers.agent.supervisor.policy import Policy
from workers.agent.supervisor.rules import exit_fields, stop_signals

# The agent fields a member part's view takes from the member agent's memory. `master_port` is not one
# of them: a member part uses the head's. (`joined_attempt`, the head attempt a part joined, lives in
# the same memory but is no record field.)
PART_FIELDS = tuple(f for f in AGENT_FIELDS if f not in ("url", "master_port"))
_BLANK = ReplicaRecord(id="", model="", profile="")


def part_view(rec: ReplicaRecord, facts: Mapping[str, Any], found: Found | None, node: str,
              now: float) -> tuple[ReplicaRecord, dict[str, Any]]:
    """The record as the decision sees it, and the part's facts to remember. The head (or a
    single-node replica) sees the record itself. For a member part of a multi-node replica the agent
    fields are this agent's own facts, since only the head writes them; with none yet, a part found
    running in the state dir is adopted, assuming it joined the head's current attempt (if the head
    has moved on since, the part cannot rejoin: it fails and restarts)."""
    if rec.node == node:
        return rec, {}
    facts = dict(facts)
    if not facts:
        if found is not None and found.alive:
            facts.update(attempt=found.attempt, pid=found.pid, pid_start=found.pid_start, started_at=now,
                         first_ready_at=now, joined_attempt=rec.attempt)
        elif node in rec.stopped_nodes:
            # This node already confirmed its part stopped (before this agent restarted).
            facts["stopped_at"] = rec.stop_requested_at or now
    blank = {f: getattr(_BLANK, f) for f in PART_FIELDS}
    view = dataclasses.replace(rec, **{**blank, **{k: v for k, v in facts.items() if k in blank}})
    return view, facts


def head_of_part(stored: ReplicaRecord, node: str, facts: Mapping[str, Any]) -> dict[str, Any]:
    """The `Observed` fields of a member part (none for the head): the head's current attempt while it
    runs (0 while it does not), and the head attempt this part joined (from the part's `facts`)."""
    if stored.node == node:
        return {}
    return dict(head_attempt=stored.attempt if stored.running else 0, joined_attempt=facts.get("joined_attempt"))


def leave_stale(rec: ReplicaRecord, obs: Observed, now: float, policy: Policy) -> list[Signal] | None:
    """A running member part whose head attempt is gone leaves its rendezvous (None: it is not stale,
    or already leaving)."""
    if not obs.stale or obs.term_sent_at is not None:
        return None
    why = f"its head restarted (attempt {obs.head_attempt})" if obs.head_attempt else "its head's attempt ended"
    return stop_signals(rec.id, obs.pid, obs.pid_start, obs.term_sent_at, now, policy, why)


def part_ended(rec: ReplicaRecord, obs: Observed, exit: ExitFacts, now: float, policy: Policy) -> list[Action] | None:
    """A member part's attempt ended: a rejoin (no failure) when its head moved on; nothing yet while
    its head may have died first; None: judge it as any exit."""
    if obs.stale:
        return [Rejoin(rec.id, exit, fields={**exit_fields(rec, exit), "next_restart_at": None},
                       message=f"part of head attempt {obs.joined_attempt} ended; rejoining the head's attempt")]
    if obs.member and now - exit.exited_at < policy.member_settle:
        return []  # its head may have died first; judge once the head's agent had time to say so
    return None


def stop_confirmation(rec: ReplicaRecord, node: str, now: float) -> dict[str, Any]:
    """Each node confirms its own part's stop (its own field: no race between the agents); a
    multi-node replica is Stopped, and its GPUs free, once every node has."""
    return {replica_stopped_on(node): now} if len(rec.all_nodes) > 1 else {}
