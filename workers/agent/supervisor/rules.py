"""Single rules the decisions and the loop share: the facts of a start, an exit, a failed launch or a
shutdown, and the one stop escalation."""

from __future__ import annotations

import logging
import signal
from typing import Any

from llmgw.state.records import ReplicaRecord
from workers.agent.supervisor.actions import Facts, LaunchFailed, Signal, Start
from workers.agent.supervisor.observed import ExitFacts
from workers.agent.supervisor.policy import Policy, next_failure


def exit_fields(rec: ReplicaRecord, exit: ExitFacts) -> dict[str, Any]:
    """How an attempt ended. An exit stamped before the attempt's start (clock skew between the shim
    and the agent) is moved to the start, so the record still reads as ended."""
    return {"exit_code": exit.exit_code, "exit_signal": exit.exit_signal,
            "exited_at": max(exit.exited_at, rec.started_at or 0.0)}


def launch_failed(rec: ReplicaRecord, attempt: int, now: float, reason: str, policy: Policy) -> LaunchFailed:
    """An attempt that failed before its process ran: counted like a crash of a never-ready run."""
    failures, next_at = next_failure(rec.failure_times, now, policy)
    fields = dict(attempt=attempt, started_at=now, exited_at=now, exit_code=None, exit_signal=None,
                  failure_times=list(failures), next_restart_at=next_at, restarts=rec.restarts + 1,
                  log_tail=f"[llmgw-agent] {reason}")
    return LaunchFailed(rec.id, attempt, now, failures, next_at, rec.restarts + 1, reason,
                        fields=fields, message=reason, level=logging.ERROR)


def starting(rec: ReplicaRecord, start: Start, now: float, port: int, url: str, master_port: int | None,
             serves_http: bool, log_path: str | None = None,
             kv_ports: tuple[int, int] | None = None, cpus: tuple[int, ...] = ()) -> dict[str, Any]:
    """The facts recorded before a new attempt's process is spawned, so a crash in between leaves a
    record the next pass reads as a failed attempt (and restarts), never an untracked process.
    `master_port`: the rendezvous port a multi-node head chose (members join this attempt on it);
    `kv_ports`: where a head publishes its KV events (the gateways connect there); `cpus`: the cores a
    CPU replica's threads are bound to (recorded so that other replicas on the node avoid them)."""
    member = start.head_attempt is not None
    fields: dict[str, Any] = dict(
        attempt=start.attempt, started_at=now, port=port, url=rec.url if member else url, pid=None, pid_start=None,
        engine_pid=None, exit_code=None, exit_signal=None, next_restart_at=None, last_probe_ok=None,
        probe_error=None, adopted_at=None,
    )
    if log_path is not None:
        fields["log_path"] = log_path
    if master_port is not None:
        fields["master_port"] = master_port
    if not member and (kv_ports is not None or rec.kv_events_port is not None):
        fields["kv_events_port"], fields["kv_replay_port"] = kv_ports or (None, None)
    if cpus or rec.cpus:
        fields["cpus"] = list(cpus)
    if not serves_http:
        fields["first_ready_at"] = now  # a headless part is "ready" while it runs
    if member:
        fields["joined_attempt"] = start.head_attempt  # a member part's memory, never a record field
    return fields


def ready_this_attempt(rec: ReplicaRecord) -> bool:
    return rec.first_ready_at is not None and rec.first_ready_at >= (rec.started_at or 0)


def stop_signals(rid: str, pid: int | None, pid_start: int | None, term_sent_at: float | None, now: float,
                 policy: Policy, reason: str, orphan: bool = False) -> list[Signal]:
    """The one escalation: SIGTERM once, then SIGKILL (every pass) once `stop_grace` is over."""
    if pid is None:
        return []
    if term_sent_at is None:
        return [Signal(rid, pid, pid_start, signal.SIGTERM, reason, orphan)]
    if now - term_sent_at >= policy.stop_grace:
        return [Signal(rid, pid, pid_start, signal.SIGKILL, reason + " (grace period over)", orphan)]
    return []



def shutdown_exit(rec: ReplicaRecord, exit: ExitFacts | None, now: float) -> Facts:
    """An attempt the agent stopped because it shuts down: recorded as ended, not as a failure (the
    next agent starts it again at once)."""
    fields = exit_fields(rec, exit or ExitFacts(None, None, now))
    return Facts(fields={**fields, "next_restart_at": None}, tail="")
