"""The node agent's decisions: a pure function over (replica records, local process facts, now).

`decide(...)` returns the actions that converge this node's processes toward its replica records;
`workers.agent.loop.Agent` observes the facts, calls it and applies what it returns. Nothing here
touches Redis, processes, the network or the clock, so every rule is unit-tested with plain data.

Rules, per replica record on this node:
- stop requested: SIGTERM the attempt (through its shim), SIGKILL its group after `stop_grace`;
  once the process is gone, mark it stopped (`stopped_at`).
- running and not known to this agent (it was started by a previous agent): adopt it, no restart.
- running but not healthy within its start timeout, or unhealthy for `liveness_timeout` after being
  ready: terminate it; its exit is then recorded as a failure like any crash.
- the attempt ended without a stop request: record the exit as a failure, with an exponential backoff
  (`backoff_base` * 2^(n-1), capped at `backoff_cap`) before the next attempt.
- not running and its backoff has passed (or it never ran): start the next attempt.
- a member part of a multi-node replica follows its head: it starts only while the head's attempt
  runs, and is stopped and started again (not counted as a failure) when the head's attempt changes,
  since its old rendezvous is gone.
And for each process found in the state dir whose replica record no longer exists: stop it.

Also pure and table-tested here: `probed` (what one `/health` result means: failure threshold,
`first_ready_at`) and `launch_failed` (an attempt that could not be launched, counted like a crash).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from llmgw.state.records import ReplicaRecord

MAX_FAILURE_TIMES = 30


@dataclass(frozen=True)
class Policy:
    backoff_base: float = 1.0  # LLMGW_AGENT_BACKOFF_BASE
    backoff_cap: float = 60.0  # LLMGW_AGENT_BACKOFF_CAP
    # A failure after this long healthy starts a new streak (so backoff starts over at backoff_base).
    backoff_reset: float = 120.0  # LLMGW_AGENT_BACKOFF_RESET
    stop_grace: float = 10.0  # LLMGW_AGENT_STOP_GRACE: SIGTERM -> SIGKILL
    liveness_timeout: float = 60.0  # LLMGW_AGENT_LIVENESS_TIMEOUT; 0 disables the liveness restart
    # A Ready replica is reported unhealthy only after this many failed probes in a row.
    probe_failures: int = 3  # LLMGW_AGENT_PROBE_FAILURES
    # Rewrite an unchanged probe result this often (seconds), so `last_probe_at` shows the agent is alive.
    probe_refresh: float = 5.0
    # A member part that ends while its head still looks up waits this long before it counts as its own
    # failure: when the head dies, the member usually notices first (its rendezvous breaks), and the
    # head's agent needs a moment to record the head's exit, which turns the member's end into a rejoin.
    member_settle: float = 3.0


@dataclass(frozen=True)
class ExitFacts:
    exit_code: int | None  # negative: killed by that signal; None: unknown
    exit_signal: int | None
    exited_at: float


@dataclass(frozen=True)
class Observed:
    """What the agent knows locally about a replica's current attempt, this tick."""

    alive: bool = False  # the attempt's shim is running (pid, start time and command line checked)
    exit: ExitFacts | None = None  # how it ended, when not alive and it had been started
    known: bool = False  # started or adopted by this agent process
    pid: int | None = None
    pid_start: int | None = None
    engine_pid: int | None = None
    term_sent_at: float | None = None  # when this agent sent SIGTERM to this attempt
    term_reason: str = ""
    last_ok_at: float | None = None  # last successful health probe of this attempt
    start_timeout: float = 120.0
    has_health: bool = True  # False for a headless part (multi-node worker): no probes, no timeouts
    # Multi-node member parts only (None on the head and on single-node replicas): the head's current
    # attempt while it runs (0 while it does not), and the head attempt this part was started for.
    head_attempt: int | None = None
    joined_attempt: int | None = None

    @property
    def member(self) -> bool:
        return self.head_attempt is not None

    @property
    def stale(self) -> bool:
        """A member part started for a head attempt that is no longer the running one."""
        return self.member and (not self.head_attempt or self.joined_attempt != self.head_attempt)


@dataclass(frozen=True)
class Orphan:
    """A live attempt found in the state dir whose replica record no longer exists."""

    replica_id: str
    pid: int
    pid_start: int | None
    term_sent_at: float | None = None


# --- actions -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    replica_id: str
    attempt: int
    restart: bool  # an earlier attempt existed
    head_attempt: int | None = None  # a member part: the head attempt it joins


@dataclass(frozen=True)
class Adopt:
    replica_id: str
    pid: int | None
    pid_start: int | None
    engine_pid: int | None


@dataclass(frozen=True)
class Signal:
    replica_id: str
    pid: int
    pid_start: int | None
    sig: int  # SIGTERM goes to the shim (which forwards it once); SIGKILL to the whole group
    reason: str
    orphan: bool = False


@dataclass(frozen=True)
class RecordExit:
    """The attempt ended without a stop request: a failure, restarted after `next_restart_at`."""

    replica_id: str
    exit: ExitFacts
    failure_times: tuple[float, ...]
    next_restart_at: float
    restarts: int
    reason: str = ""


@dataclass(frozen=True)
class MarkStopped:
    replica_id: str
    exit: ExitFacts | None
    stopped_at: float


@dataclass(frozen=True)
class Rejoin:
    """A member part ended because its head's attempt changed: start again for the new one, no failure."""

    replica_id: str
    exit: ExitFacts


@dataclass(frozen=True)
class LaunchFailed:
    """An attempt that could not even be launched (adapter error, no free port, shim failed to start):
    a failure like a crash, with the same streak and backoff."""

    replica_id: str
    attempt: int
    at: float
    failure_times: tuple[float, ...]
    next_restart_at: float
    restarts: int
    reason: str


@dataclass(frozen=True)
class Probed:
    """The outcome of one `/health` probe. `fields` are the facts to write (empty: nothing to report
    this time); `probe_failures` is the new count of failures in a row; `became_ready` the first success
    of this attempt."""

    replica_id: str
    ok: bool
    probe_failures: int
    fields: dict[str, Any] = field(default_factory=dict)
    became_ready: bool = False


Action = Start | Adopt | Signal | RecordExit | MarkStopped | Rejoin


def backoff(failures: int, policy: Policy) -> float:
    """Seconds before the next attempt after `failures` failures in a row: 1, 2, 4 ... capped."""
    if failures <= 0:
        return 0.0
    return min(policy.backoff_cap, policy.backoff_base * (2 ** min(failures - 1, 30)))


def _next_failure(previous: list[float], at: float, policy: Policy) -> tuple[tuple[float, ...], float]:
    """(failure times, next restart time) after a failure at `at`, given the current streak."""
    failures = (list(previous) + [at])[-MAX_FAILURE_TIMES:]
    return tuple(failures), max(at, 0.0) + backoff(len(failures), policy)


def launch_failed(rec: ReplicaRecord, attempt: int, now: float, reason: str, policy: Policy) -> LaunchFailed:
    """An attempt that failed before its process ran: counted like a crash of a never-ready run."""
    failures, next_at = _next_failure(rec.failure_times, now, policy)
    return LaunchFailed(rec.id, attempt, now, failures, next_at, rec.restarts + 1, reason)


def probed(rec: ReplicaRecord, failures_before: int, ok: bool, error: str | None, now: float,
           policy: Policy) -> Probed:
    """What one probe result means for the record: a Ready replica turns unhealthy only after
    `policy.probe_failures` failures in a row (one slow answer from a busy engine is not an outage,
    like kubelet's failureThreshold); the first success of an attempt is its `first_ready_at`; an
    unchanged result is rewritten only every `probe_refresh` seconds."""
    failures = 0 if ok else failures_before + 1
    ready = ready_this_attempt(rec)
    if not ok and ready and rec.last_probe_ok and failures < policy.probe_failures:
        return Probed(rec.id, ok, failures)
    fields: dict[str, Any] = {"last_probe_at": now, "last_probe_ok": ok, "probe_error": error}
    became_ready = ok and not ready
    if became_ready:
        fields["first_ready_at"] = now
    changed = rec.last_probe_ok != ok or rec.probe_error != error or became_ready
    if not changed and now - (rec.last_probe_at or 0) < policy.probe_refresh:
        return Probed(rec.id, ok, failures)
    return Probed(rec.id, ok, failures, fields, became_ready)


def ready_this_attempt(rec: ReplicaRecord) -> bool:
    return rec.first_ready_at is not None and rec.first_ready_at >= (rec.started_at or 0)


def _stop_signals(rid: str, obs: Observed, now: float, policy: Policy, reason: str, orphan=False):
    """SIGTERM once, then SIGKILL every pass once the grace period is over."""
    if obs.pid is None:
        return []
    if obs.term_sent_at is None:
        return [Signal(rid, obs.pid, obs.pid_start, signal.SIGTERM, reason, orphan)]
    if now - obs.term_sent_at >= policy.stop_grace:
        return [Signal(rid, obs.pid, obs.pid_start, signal.SIGKILL, reason + " (grace period over)", orphan)]
    return []


def decide_one(rec: ReplicaRecord, obs: Observed, now: float, policy: Policy) -> list[Action]:
    rid = rec.id
    if rec.stop_requested_at is not None:
        if rec.stopped_at is not None:
            return []
        if obs.alive:
            return _stop_signals(rid, obs, now, policy, f"stop requested: {rec.stop_reason or 'no reason'}")
        return [MarkStopped(rid, obs.exit, now)]

    if obs.alive:
        actions: list[Action] = []
        if not obs.known:
            # Adopt first; judge its health from the next pass on, with probes of our own.
            return [Adopt(rid, obs.pid, obs.pid_start, obs.engine_pid)]
        if obs.stale and obs.term_sent_at is None:
            why = (f"its head restarted (attempt {obs.head_attempt})" if obs.head_attempt
                   else "its head's attempt ended")
            return _stop_signals(rid, obs, now, policy, why)
        if obs.term_sent_at is not None:
            # Already being terminated (start timeout or liveness): escalate, then record the exit.
            return actions + _stop_signals(rid, obs, now, policy, obs.term_reason)
        started = rec.started_at if rec.started_at is not None else now
        if not obs.has_health:
            return actions
        if not ready_this_attempt(rec):
            if now - started > obs.start_timeout:
                reason = f"not healthy within its start timeout of {obs.start_timeout:g}s"
                actions += _stop_signals(rid, obs, now, policy, reason)
        elif policy.liveness_timeout > 0:
            last_ok = max(obs.last_ok_at or 0.0, rec.first_ready_at or 0.0,
                          (rec.last_probe_at or 0.0) if rec.last_probe_ok else 0.0)
            if now - last_ok > policy.liveness_timeout:
                reason = f"health probe failing for over {policy.liveness_timeout:g}s"
                actions += _stop_signals(rid, obs, now, policy, reason)
        return actions

    if rec.running:
        exit = obs.exit or ExitFacts(None, None, now)
        if obs.stale:
            return [Rejoin(rid, exit)]  # ended because its head moved on: not its own failure
        if obs.member and now - exit.exited_at < policy.member_settle:
            return []  # its head may have died first; judge once the head's agent had time to say so
        # The attempt ended, and nobody asked it to: a failure.
        previous = list(rec.failure_times)
        healthy_for = exit.exited_at - (rec.first_ready_at or exit.exited_at) if ready_this_attempt(rec) else 0.0
        if healthy_for >= policy.backoff_reset:
            previous = []  # a long healthy run ends the streak
        failures, next_at = _next_failure(previous, exit.exited_at, policy)
        return [RecordExit(rid, exit, failures, next_at, rec.restarts + 1, obs.term_reason)]

    if obs.member and not obs.head_attempt:
        return []  # a member part joins a running head attempt only (it needs the head's rendezvous)
    if rec.next_restart_at is None or now >= rec.next_restart_at:
        return [Start(rid, rec.attempt + 1, restart=rec.attempt > 0, head_attempt=obs.head_attempt)]
    return []


def decide(
    records: list[ReplicaRecord],
    observed: dict[str, Observed],
    orphans: list[Orphan],
    now: float,
    policy: Policy = Policy(),
) -> list[Action]:
    """Every action for this pass. `records` are this node's records (for a multi-node replica's
    member part, the agent passes a view whose agent fields come from its local memory)."""
    actions: list[Action] = []
    for rec in records:
        actions += decide_one(rec, observed.get(rec.id, Observed()), now, policy)
    for o in orphans:
        obs = Observed(alive=True, pid=o.pid, pid_start=o.pid_start, term_sent_at=o.term_sent_at)
        actions += _stop_signals(o.replica_id, obs, now, policy, "its replica record was deleted", orphan=True)
    return actions
