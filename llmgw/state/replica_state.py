"""Derive the state a user sees from the facts stored in a replica record.

One pure function, table-tested (tests/unit/test_replica_state.py). Nothing stores a state: the
control plane, the publisher, `llmgw status` and the agent all call `derive`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Container

from llmgw.state.records import ReplicaRecord


class State(str, enum.Enum):
    PENDING = "Pending"  # no node could take it yet (see pending_reason)
    LAUNCHING = "Launching"  # placed, the agent has not started a process yet
    STARTING = "Starting"  # process running, not yet healthy
    READY = "Ready"  # healthy: routable
    UNHEALTHY = "Unhealthy"  # was Ready this attempt, the last probe failed
    FAILED = "Failed"  # exited unexpectedly; the agent restarts it after a backoff
    CRASHLOOP = "CrashLoop"  # failed too often in the window; the control plane may move it
    STOPPING = "Stopping"  # stop requested, process not yet confirmed gone
    STOPPED = "Stopped"  # stop requested and the process is gone: the record may be deleted
    LOST = "Lost"  # its node's heartbeat expired


@dataclass(frozen=True)
class CrashPolicy:
    """How many unexpected exits within `window` seconds make a CrashLoop.

    The window must span several capped restart backoffs (the agent retries a crash-looping engine
    every 60 s at most), or a replica that never recovers would flicker back to Failed."""

    max_failures: int = 4
    window: float = 600.0


@dataclass(frozen=True)
class StateView:
    state: State
    reason: str = ""


def recent_failures(rec: ReplicaRecord, now: float, policy: CrashPolicy) -> int:
    return sum(1 for t in rec.failure_times if now - t <= policy.window)


def derive(
    rec: ReplicaRecord, node_alive: bool, now: float, policy: CrashPolicy = CrashPolicy()
) -> StateView:
    if rec.stop_requested_at is not None:
        if rec.node is None:
            return StateView(State.STOPPED, rec.stop_reason or "")
        nodes = rec.all_nodes
        if len(nodes) > 1:
            # Every node's agent confirms its own part: the head's `stopped_at` alone would free the
            # GPUs of a member whose process still runs.
            waiting = [n for n in nodes if n not in rec.stopped_nodes]
        else:
            waiting = [] if rec.stopped_at is not None else nodes
        if not waiting:
            return StateView(State.STOPPED, rec.stop_reason or "")
        if not node_alive:
            # Nobody can confirm the stop; the reconciler treats it as gone for routing purposes.
            return StateView(State.LOST, f"stopping on {', '.join(waiting)}, whose heartbeat expired")
        if len(nodes) > 1:
            return StateView(State.STOPPING, f"{rec.stop_reason or 'stop requested'}; waiting for "
                                             f"{', '.join(waiting)} to confirm")
        return StateView(State.STOPPING, rec.stop_reason or "")
    if rec.node is None:
        return StateView(State.PENDING, rec.pending_reason or "not placed yet")
    if not node_alive:
        return StateView(State.LOST, f"node {rec.node} stopped sending heartbeats")
    failures = recent_failures(rec, now, policy)
    if not rec.running:
        if failures >= policy.max_failures:
            return StateView(
                State.CRASHLOOP,
                f"{failures} failures in {policy.window:g}s; last exit {_exit_text(rec)}",
            )
        if rec.exited_at is not None:
            return StateView(State.FAILED, f"exited {_exit_text(rec)}")
        return StateView(State.LAUNCHING, "waiting for the node agent")
    if rec.first_ready_at is not None and rec.first_ready_at >= (rec.started_at or 0):
        if rec.last_probe_ok:
            return StateView(State.READY)
        return StateView(State.UNHEALTHY, rec.probe_error or "health probe failing")
    return StateView(State.STARTING, rec.probe_error or "")


def _exit_text(rec: ReplicaRecord) -> str:
    if rec.exit_signal:
        return f"by signal {rec.exit_signal}"
    if rec.exit_code is not None:
        return f"with code {rec.exit_code}"
    return "(status unknown)"


def nodes_alive(rec: ReplicaRecord, live: "Container[str]") -> bool:
    """A replica's node is alive when every node it spans sends heartbeats."""
    nodes = rec.all_nodes
    return bool(nodes) and all(n in live for n in nodes)


def is_routable(view: StateView) -> bool:
    return view.state is State.READY
