"""Derive the state a user sees from the facts stored in a replica record (and, for the servers
llmgw does not run, in an external url's record).

One pure function each, table-tested (tests/unit/test_replica_state.py). Nothing stores a state: the
control plane, the publisher, `llmgw status` and the agent all call `derive` / `derive_external`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Container, Iterable

from llmgw.proc.exitstatus import describe_exit
from llmgw.state.demand_records import GatewayReport
from llmgw.state.records import ExternalRecord, LoadRecord, ReplicaRecord


class State(str, enum.Enum):
    PENDING = "Pending"  # no node could take it yet (see pending_reason)
    LAUNCHING = "Launching"  # placed, the agent has not started a process yet
    STARTING = "Starting"  # process running, not yet healthy
    READY = "Ready"  # healthy: routable
    UNHEALTHY = "Unhealthy"  # was Ready this attempt, the last probe failed
    FAILED = "Failed"  # exited unexpectedly; the agent restarts it after a backoff
    CRASHLOOP = "CrashLoop"  # failed too often in the window; the control plane may move it
    DRAINING = "Draining"  # stop requested: unpublished, in-flight requests finishing (docs/lifecycle.md)
    STOPPING = "Stopping"  # drained (or no drain): terminating, process not yet confirmed gone
    STOPPED = "Stopped"  # stop requested and the process is gone: the record may be deleted
    LOST = "Lost"  # its node's heartbeat expired
    CHECKING = "Checking"  # an external url not health-checked yet
    UNREACHABLE = "Unreachable"  # an external url whose checks fail
    DOWNLOADING = "Downloading"  # placed; its node agent makes the weights local before the engine starts


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
        if draining(rec):
            return StateView(State.DRAINING, rec.stop_reason or "")
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
        if downloading(rec):
            return StateView(State.DOWNLOADING, download_text(rec))
        fetch_failed = download_failed(rec)
        if failures >= policy.max_failures:
            last = f"last: {_download_error(rec)}" if fetch_failed else f"last exit {_exit_text(rec)}"
            return StateView(State.CRASHLOOP, f"{failures} failures in {policy.window:g}s; {last}")
        if fetch_failed:
            return StateView(State.FAILED, _download_error(rec))
        if rec.exited_at is not None:
            return StateView(State.FAILED, _exit_text(rec))
        return StateView(State.LAUNCHING, "waiting for the node agent")
    if rec.first_ready_at is not None and rec.first_ready_at >= (rec.started_at or 0):
        if rec.last_probe_ok:
            return StateView(State.READY)
        return StateView(State.UNHEALTHY, rec.probe_error or "health probe failing")
    return StateView(State.STARTING, rec.probe_error or "")


def downloading(rec: ReplicaRecord) -> bool:
    """Its node agent is making a remote source's weights local (the engine starts once they are)."""
    return rec.weights_source is not None and rec.weights_local_at is None and \
        rec.weights_phase not in (None, "failed")


def download_failed(rec: ReplicaRecord) -> bool:
    """The last download of its weights failed (and the agent tries again after a backoff)."""
    return rec.weights_phase == "failed" and rec.weights_local_at is None


def download_text(rec: ReplicaRecord) -> str:
    """"41% 3.2 of 7.8 GiB, 110.0 MiB/s, ETA 42s", or what the download waits for."""
    phase = rec.weights_phase
    if phase == "queued":
        return f"queued: other downloads of this node come first ({rec.weights_source})"
    if phase == "resolving":
        return f"resolving {rec.weights_source}"
    done, total = rec.weights_done, rec.weights_total
    size = _bytes(done)
    if total:
        whole = _bytes(total)
        unit = whole.rsplit(" ", 1)[1]
        size = f"{size.rsplit(' ', 1)[0] if size.endswith(unit) else size} of {whole}"
    text = (f"{done / total:.0%} " if total else "") + size
    if rec.weights_rate is not None:
        text += f", {_bytes(rec.weights_rate)}/s"
    if rec.weights_eta is not None:
        text += f", ETA {_seconds(rec.weights_eta)}"
    if phase == "waiting":
        text += f"; another download of {rec.weights_file or 'the same file'} on this node holds it"
    elif phase == "verifying":
        text += "; verifying the checksum"
    return text


def _download_error(rec: ReplicaRecord) -> str:
    return f"download failed ({rec.weights_error_kind or 'error'}): {rec.weights_error or 'no reason given'}"


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1024 ** 3:.1f} GiB" if abs(n) >= 1024 ** 3 else f"{n / 1024 ** 2:.1f} MiB"


def _seconds(s: float) -> str:
    s = max(0.0, s)
    return f"{s:.0f}s" if s < 120 else (f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h")


def served_this_attempt(rec: ReplicaRecord) -> bool:
    """The current attempt runs and became Ready at some point: gateways may have requests on it."""
    return rec.running and rec.first_ready_at is not None and rec.first_ready_at >= (rec.started_at or 0)


def draining(rec: ReplicaRecord) -> bool:
    """A planned stop whose drain is not over: the process still serves what it was given."""
    return (rec.stop_requested_at is not None and rec.drain_timeout > 0 and rec.drained_at is None
            and served_this_attempt(rec))


@dataclass(frozen=True)
class DrainProgress:
    """Where the drain of a planned stop stands. `done`: the agent may send SIGTERM now."""

    done: bool
    inflight: int = 0  # requests still on the replica, as far as anyone can tell
    note: str = ""


# Engine load older than this (seconds) says nothing about what runs now.
LOAD_FRESH_FOR = 5.0


def drain_progress(rec: ReplicaRecord, gateways: Iterable[GatewayReport], load: LoadRecord | None,
                   now: float) -> DrainProgress:
    """The stop sequence of docs/lifecycle.md, pure: a planned stop may terminate the engine once
    (1) the publisher unpublished it (`unpublished_version`), (2) every live gateway routes by that
    list or a newer one, and (3) nothing is in flight on it: the gateways' counts for it and the
    engine's own running + waiting (when freshly scraped) are 0. Or once `drain_timeout` is over,
    whatever is left. A replica that never served this attempt has nothing to drain."""
    if rec.stop_requested_at is None:
        return DrainProgress(False, note="no stop requested")
    if rec.drained_at is not None:
        return DrainProgress(True, note=rec.drain_note or "drained")
    if rec.drain_timeout <= 0 or not served_this_attempt(rec):
        return DrainProgress(True, note="nothing to drain")
    gateways = list(gateways)
    on_gateways = sum(u.inflight for g in gateways if (u := g.endpoints.get(rec.id)) is not None)
    on_engine = 0
    if load is not None and load.ok and now - load.ts <= LOAD_FRESH_FOR:
        on_engine = int((load.running or 0) + (load.waiting or 0))
    inflight = max(on_gateways, on_engine)
    if now >= rec.stop_requested_at + rec.drain_timeout:
        return DrainProgress(True, inflight, f"drain timed out after {rec.drain_timeout:g}s with "
                                             f"{inflight} in flight")
    if rec.unpublished_version is None:
        return DrainProgress(False, inflight, "waiting for the publisher to unpublish it")
    lagging = [g for g in gateways if g.version < rec.unpublished_version]
    if lagging:
        return DrainProgress(False, inflight, f"waiting for {len(lagging)} gateway(s) to load endpoint "
                                              f"list v{rec.unpublished_version}")
    if inflight:
        return DrainProgress(False, inflight, f"{inflight} in flight")
    return DrainProgress(True, 0, "drained")


def head_drained(rec: ReplicaRecord, now: float) -> DrainProgress:
    """For a member part of a multi-node replica (`rec` as stored: the head's facts): its head serves
    HTTP and drains; the member part may stop once the head's drain is over, or timed out, or the head
    does not serve at all."""
    if rec.drained_at is not None:
        return DrainProgress(True, note=rec.drain_note or "the head drained")
    if rec.drain_timeout <= 0 or not served_this_attempt(rec):
        return DrainProgress(True, note="nothing to drain")
    if rec.stop_requested_at is not None and now >= rec.stop_requested_at + rec.drain_timeout:
        return DrainProgress(True, note=f"drain timed out after {rec.drain_timeout:g}s")
    return DrainProgress(False, note="waiting for the head to drain")


def _exit_text(rec: ReplicaRecord) -> str:
    """How the last attempt ended, in words (`llmgw.proc.exitstatus`), and where its log is."""
    text = describe_exit(rec.exit_code, rec.exit_signal)
    if rec.log_path:
        text += f"; engine log: {rec.node}:{rec.log_path}" if rec.node else f"; engine log: {rec.log_path}"
    return text


def nodes_alive(rec: ReplicaRecord, live: "Container[str]") -> bool:
    """A replica's node is alive when every node it spans sends heartbeats."""
    nodes = rec.all_nodes
    return bool(nodes) and all(n in live for n in nodes)


def is_routable(view: StateView) -> bool:
    return view.state is State.READY


def derive_external(rec: ExternalRecord | None) -> StateView:
    """An external url is Ready once a health check passed, until `unreachable_after` checks in a
    row failed (one failure does not take a server that answered out of routing); a url that never
    answered is Unreachable from its first failed check."""
    if rec is None or rec.checked_at is None:
        return StateView(State.CHECKING, "not health-checked yet")
    if rec.failures == 0:
        return StateView(State.READY, "")
    streak = f"{rec.failures} check{'s' if rec.failures != 1 else ''} in a row failed: {rec.error or 'unknown error'}"
    if rec.last_ok_at is not None and rec.failures < rec.unreachable_after:
        return StateView(State.READY, streak)
    return StateView(State.UNREACHABLE, streak if rec.last_ok_at is not None else f"never answered: {rec.error}")
