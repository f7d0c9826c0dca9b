"""What is left of deleted replicas on this node: attempts to stop, files to remove, and (when Redis
lost its data) records to register again."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from llmgw.state.records import ReplicaRecord
from workers.agent.supervisor.observed import Found, Orphan


@dataclass(frozen=True)
class Leftovers:
    orphans: tuple[Orphan, ...] = ()  # live attempts to stop
    left_alone: int = 0  # live attempts not stopped, because Redis holds no catalog at all
    remove: tuple[str, ...] = ()  # replica dirs to delete
    # Records to register again (Redis holds no catalog: it lost its data), from the copy this node's
    # agent saved when it started the attempt, with the attempt's live facts.
    restore: tuple[ReplicaRecord, ...] = ()


def leftovers(found: Mapping[str, Found], record_ids: set[str], terms: Mapping[str, float],
              catalog_applied: bool, dirs: Mapping[str, float], now: float, retention: float,
              saved: Mapping[str, ReplicaRecord] | None = None, node: str = "") -> Leftovers:
    """What to do about attempts and files of replicas whose record is gone. `terms`: when this agent
    sent SIGTERM to an orphan; `dirs`: replica dir -> last activity (mtime) for dirs without a record;
    `saved`: the record each attempt was started with (saved in its dir), where there is one."""
    orphans = tuple(Orphan(rid, f.pid, f.pid_start, terms.get(rid)) for rid, f in sorted(found.items())
                    if rid not in record_ids and f.alive)
    left_alone, restore = 0, ()
    if orphans and not catalog_applied:
        # No catalog at all: this Redis was wiped or is the wrong one (a mistyped REDIS_URL). Don't
        # read that as "every replica was deleted" and stop every engine on the node. Register again
        # the attempts this node heads, so that when the operator re-applies the catalog the control
        # plane counts them instead of starting a second set (member parts follow their head's record).
        saved = saved or {}
        restore = tuple(restored(saved[o.replica_id], found[o.replica_id]) for o in orphans
                        if o.replica_id in saved and saved[o.replica_id].node == node)
        orphans, left_alone = (), len(orphans) - len(restore)
    remove = tuple(rid for rid, last in sorted(dirs.items())
                   if rid not in record_ids and not (rid in found and found[rid].alive) and now - last > retention)
    return Leftovers(orphans, left_alone, remove, restore)


def restored(saved: ReplicaRecord, found: Found) -> ReplicaRecord:
    """The record of a running attempt, registered again after Redis lost it: the placement and launch
    facts saved when the attempt started, its live process facts, and nothing that says it ended or
    was ever probed (the agent adopts it, probes it and reports it Ready like any adopted engine)."""
    return dataclasses.replace(
        saved, attempt=found.attempt, pid=found.pid, pid_start=found.pid_start, engine_pid=found.engine_pid,
        exit_code=None, exit_signal=None, exited_at=None, stopped_at=None, adopted_at=None, first_ready_at=None,
        last_probe_at=None, last_probe_ok=None, probe_error=None, next_restart_at=None, drained_at=None,
        drain_note=None, stopped_nodes=[])
