"""The node agent's decisions: pure functions over (this node's replica records, what the agent
observed of their processes, now).

`decide(...)` returns the actions that converge this node's processes toward its replica records.
Every action that records something carries the exact fields to write (`Facts`), so
`workers.agent.loop.Agent` only observes, calls `decide`, writes each replica's fields once and
performs the process side effects (start, signal). Nothing here touches Redis, processes, the network
or the clock, so every rule is table-tested with plain data (tests/unit/test_agent_supervisor.py).

Rules, per replica record on this node:
- stop requested: a planned stop drains first (docs/lifecycle.md): while the drain is not over
  (`Observed.drain`, from `llmgw.state.replica_state.drain_progress`: unpublished, every gateway
  moved on, nothing in flight; or `drain_timeout` passed) the engine keeps serving what it has.
  Then the head records `drained_at` and the attempt gets SIGTERM (through its shim), SIGKILL of its
  group after `stop_grace` (`stop_signals`, the one escalation, also used when the agent shuts
  down); a member part of a multi-node replica waits for its head's drain. Once the process is gone,
  mark it stopped (`stopped_at`; each node of a multi-node replica confirms its own part).
- running and not known to this agent (it was started by a previous agent): adopt it, no restart.
  A member part of a multi-node replica is adopted from the attempt found in the state dir
  (`part_view`), since only the head writes the record's agent fields.
- running but not healthy within its start timeout, or unhealthy for `liveness_timeout` after being
  ready: terminate it; its exit is then recorded as a failure like any crash.
- the attempt ended without a stop request: record the exit as a failure, with an exponential backoff
  (`backoff_base` * 2^(n-1), capped at `backoff_cap`) before the next attempt.
- not running and its backoff has passed (or it never ran): start the next attempt (`starting` gives
  the facts recorded before the process is spawned).
- a member part of a multi-node replica follows its head: it starts only while the head's attempt
  runs, and is stopped and started again (not counted as a failure) when the head's attempt changes,
  since its old rendezvous is gone.
And for each live attempt found in the state dir whose replica record no longer exists: stop it
(`leftovers`), unless Redis holds no catalog at all (it lost its data): then the record is registered
again from the copy saved when the attempt started (`restored`); a deleted replica's files go after
`dir_retention`.

Also here: `probed` (what one `/health` result means), `launch_failed` (an attempt that could not be
launched, counted like a crash), `remember` (this agent's memory of an attempt, after an action) and
`shutdown_exit` (an exit recorded when the agent stops its engines).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from dataclasses import dataclass, field
from typing import Any, Mapping

from llmgw.proc.exitstatus import describe_exit
from llmgw.state.keys import replica_stopped_on
from llmgw.state.records import AGENT_FIELDS, ReplicaRecord
from llmgw.state.kicks import PUBLISH, RECONCILE
from llmgw.state.replica_state import CrashPolicy, DrainProgress

MAX_FAILURE_TIMES = 30
LOG_TAIL_BYTES = 4000  # of the engine log kept in the record when an attempt ends


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
class Found:
    """An attempt found in the state dir (`shim.json`): for adopting a member part, for orphans, and
    for a pid that never reached Redis."""

    replica_id: str
    attempt: int
    pid: int
    pid_start: int | None
    engine_pid: int | None
    alive: bool


@dataclass(frozen=True)
class Attempt:
    """What this agent process remembers of one replica's current attempt (lost when it restarts;
    everything that must survive a restart is in Redis or the state dir)."""

    attempt: int = 0
    known: bool = False  # started or adopted by this agent process
    term_sent_at: float | None = None  # when this agent sent SIGTERM to this attempt
    term_reason: str = ""
    last_ok_at: float | None = None  # last successful health probe
    last_probe_at: float | None = None
    probe_failures: int = 0  # failed probes in a row


@dataclass(frozen=True)
class Observed:
    """What the agent knows locally about a replica's current attempt, this pass."""

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
    # A stop was requested and the process runs: how far its drain has come (None: no drain, stop now).
    drain: DrainProgress | None = None
    # This pass's `/health` probe, when one was due: its result and the failures in a row before it.
    probe_ok: bool | None = None
    probe_error: str | None = None
    probe_failures: int = 0

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
@dataclass(frozen=True, kw_only=True)
class Facts:
    """What an action records. `fields`: facts of this node's part of the replica (the record's agent
    fields for the head or a single-node replica; the agent's memory for a member part, whose record
    fields are the head's). `confirm`: fields written to the record whoever runs the part (a node's
    `stopped_on:<node>`). `tail`: record the end of the engine log as `log_tail`, followed by this note
    (None: leave `log_tail` alone). `message`/`level`: the line to log."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    confirm: Mapping[str, Any] = field(default_factory=dict)
    tail: str | None = None
    message: str = field(default="", compare=False)
    level: int = field(default=logging.INFO, compare=False)


@dataclass(frozen=True)
class Start:
    """Start the next attempt: the loop chooses its port and builds its command, records `starting`
    (or `launch_failed`), then spawns it."""

    replica_id: str
    attempt: int
    restart: bool  # an earlier attempt existed
    head_attempt: int | None = None  # a member part: the head attempt it joins


@dataclass(frozen=True)
class Adopt(Facts):
    replica_id: str
    pid: int | None
    pid_start: int | None
    engine_pid: int | None


@dataclass(frozen=True)
class Learned(Facts):
    """Facts of a known running attempt the record lacks (the engine's pid, once the shim started it)."""

    replica_id: str


@dataclass(frozen=True)
class Signal:
    replica_id: str
    pid: int
    pid_start: int | None
    sig: int  # SIGTERM goes to the shim (which forwards it once); SIGKILL to the whole group
    reason: str
    orphan: bool = False


@dataclass(frozen=True)
class Drained(Facts):
    """The drain of a planned stop is over (or timed out): recorded by the head before its SIGTERM."""

    replica_id: str


@dataclass(frozen=True)
class RecordExit(Facts):
    """The attempt ended without a stop request: a failure, restarted after `next_restart_at`."""

    replica_id: str
    exit: ExitFacts
    failure_times: tuple[float, ...]
    next_restart_at: float
    restarts: int
    reason: str = ""


@dataclass(frozen=True)
class MarkStopped(Facts):
    replica_id: str
    exit: ExitFacts | None
    stopped_at: float


@dataclass(frozen=True)
class Rejoin(Facts):
    """A member part ended because its head's attempt changed: start again for the new one, no failure."""

    replica_id: str
    exit: ExitFacts


@dataclass(frozen=True)
class LaunchFailed(Facts):
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
class Probed(Facts):
    """The outcome of one `/health` probe. `fields` are the facts to write (empty: nothing to report
    this time); `probe_failures` is the new count of failures in a row; `became_ready` the first success
    of this attempt."""

    replica_id: str
    ok: bool
    probe_failures: int
    became_ready: bool = False


Action = Start | Adopt | Learned | Drained | Signal | RecordExit | MarkStopped | Rejoin | LaunchFailed | Probed


# --- single rules ------------------------------------------------------------------------------------
def backoff(failures: int, policy: Policy) -> float:
    """Seconds before the next attempt after `failures` failures in a row: 1, 2, 4 ... capped."""
    if failures <= 0:
        return 0.0
    return min(policy.backoff_cap, policy.backoff_base * (2 ** min(failures - 1, 30)))


def _next_failure(previous: list[float], at: float, policy: Policy) -> tuple[tuple[float, ...], float]:
    """(failure times, next restart time) after a failure at `at`, given the current streak."""
    failures = (list(previous) + [at])[-MAX_FAILURE_TIMES:]
    return tuple(failures), max(at, 0.0) + backoff(len(failures), policy)


def _exit_fields(rec: ReplicaRecord, exit: ExitFacts) -> dict[str, Any]:
    """How an attempt ended. An exit stamped before the attempt's start (clock skew between the shim
    and the agent) is moved to the start, so the record still reads as ended."""
    return {"exit_code": exit.exit_code, "exit_signal": exit.exit_signal,
            "exited_at": max(exit.exited_at, rec.started_at or 0.0)}


def launch_failed(rec: ReplicaRecord, attempt: int, now: float, reason: str, policy: Policy) -> LaunchFailed:
    """An attempt that failed before its process ran: counted like a crash of a never-ready run."""
    failures, next_at = _next_failure(rec.failure_times, now, policy)
    fields = dict(attempt=attempt, started_at=now, exited_at=now, exit_code=None, exit_signal=None,
                  failure_times=list(failures), next_restart_at=next_at, restarts=rec.restarts + 1,
                  log_tail=f"[llmgw-agent] {reason}")
    return LaunchFailed(rec.id, attempt, now, failures, next_at, rec.restarts + 1, reason,
                        fields=fields, message=reason, level=logging.ERROR)


def starting(rec: ReplicaRecord, start: Start, now: float, port: int, url: str, master_port: int | None,
             serves_http: bool, log_path: str | None = None) -> dict[str, Any]:
    """The facts recorded before a new attempt's process is spawned, so a crash in between leaves a
    record the next pass reads as a failed attempt (and restarts), never an untracked process.
    `master_port`: the rendezvous port a multi-node head chose (members join this attempt on it)."""
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
    if not serves_http:
        fields["first_ready_at"] = now  # a headless part is "ready" while it runs
    if member:
        fields["joined_attempt"] = start.head_attempt  # a member part's memory, never a record field
    return fields


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
    message = f"ready at {rec.url} (attempt {rec.attempt})" if became_ready else ""
    return Probed(rec.id, ok, failures, became_ready, fields=fields, message=message)


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


def _terminate(rid: str, obs: Observed, now: float, policy: Policy, reason: str) -> list[Signal]:
    return stop_signals(rid, obs.pid, obs.pid_start, obs.term_sent_at, now, policy, reason)


def shutdown_exit(rec: ReplicaRecord, exit: ExitFacts | None, now: float) -> Facts:
    """An attempt the agent stopped because it shuts down: recorded as ended, not as a failure (the
    next agent starts it again at once)."""
    fields = _exit_fields(rec, exit or ExitFacts(None, None, now))
    return Facts(fields={**fields, "next_restart_at": None}, tail="")


# --- one replica -------------------------------------------------------------------------------------
def decide_one(rec: ReplicaRecord, obs: Observed, now: float, policy: Policy, node: str = "") -> list[Action]:
    """The actions for one replica; `rec` is the view of this node's part (see `part_view`)."""
    actions: list[Action] = []
    if obs.probe_ok is not None:
        # The rest of the pass sees the record as this probe leaves it (e.g. just Ready).
        outcome = probed(rec, obs.probe_failures, obs.probe_ok, obs.probe_error, now, policy)
        actions.append(outcome)
        rec = dataclasses.replace(rec, **outcome.fields)
    return actions + _decide(rec, obs, now, policy, node)


def _decide(rec: ReplicaRecord, obs: Observed, now: float, policy: Policy, node: str) -> list[Action]:
    rid = rec.id
    if rec.stop_requested_at is not None:
        if rec.stopped_at is not None:
            return []
        if obs.alive:
            learned: list[Action] = list(_learned(rec, obs))
            drain = obs.drain
            if obs.term_sent_at is None and drain is not None:
                if not drain.done:
                    return learned  # still serving what it was given; nothing new reaches it
                if not obs.member and rec.drained_at is None:
                    learned.append(Drained(rid, fields={"drained_at": now, "drain_note": drain.note},
                                           message=f"drain over: {drain.note}"))
            return learned + _terminate(rid, obs, now, policy, f"stop requested: {rec.stop_reason or 'no reason'}")
        return [_mark_stopped(rec, obs.exit, now, node)]

    if obs.alive:
        if not obs.known:
            # Adopt first; judge its health from the next pass on, with probes of our own.
            return [_adopt(rec, obs, now)]
        learned = _learned(rec, obs)
        if obs.stale and obs.term_sent_at is None:
            why = (f"its head restarted (attempt {obs.head_attempt})" if obs.head_attempt
                   else "its head's attempt ended")
            return learned + _terminate(rid, obs, now, policy, why)
        if obs.term_sent_at is not None:
            # Already being terminated (start timeout or liveness): escalate, then record the exit.
            return learned + _terminate(rid, obs, now, policy, obs.term_reason)
        if not obs.has_health:
            return learned
        started = rec.started_at if rec.started_at is not None else now
        if not ready_this_attempt(rec):
            if now - started > obs.start_timeout:
                reason = f"not healthy within its start timeout of {obs.start_timeout:g}s"
                return learned + _terminate(rid, obs, now, policy, reason)
        elif policy.liveness_timeout > 0:
            last_ok = max(obs.last_ok_at or 0.0, rec.first_ready_at or 0.0,
                          (rec.last_probe_at or 0.0) if rec.last_probe_ok else 0.0)
            if now - last_ok > policy.liveness_timeout:
                reason = f"health probe failing for over {policy.liveness_timeout:g}s"
                return learned + _terminate(rid, obs, now, policy, reason)
        return learned

    if rec.running:
        exit = obs.exit or ExitFacts(None, None, now)
        if obs.stale:
            # Ended because its head moved on: not its own failure.
            return [Rejoin(rid, exit, fields={**_exit_fields(rec, exit), "next_restart_at": None},
                           message=f"part of head attempt {obs.joined_attempt} ended; rejoining the head's attempt")]
        if obs.member and now - exit.exited_at < policy.member_settle:
            return []  # its head may have died first; judge once the head's agent had time to say so
        return [_record_exit(rec, obs, exit, now, policy)]

    if obs.member and not obs.head_attempt:
        return []  # a member part joins a running head attempt only (it needs the head's rendezvous)
    if rec.next_restart_at is None or now >= rec.next_restart_at:
        return [Start(rid, rec.attempt + 1, restart=rec.attempt > 0, head_attempt=obs.head_attempt)]
    return []


def _adopt(rec: ReplicaRecord, obs: Observed, now: float) -> Adopt:
    fields: dict[str, Any] = {}
    if not obs.member:  # a member part's facts came from the state dir already (`part_view`)
        fields["adopted_at"] = now
        if rec.pid is None:  # started by an agent that died before recording its pid
            fields.update(pid=obs.pid, pid_start=obs.pid_start)
        fields.update(_engine_pid(rec, obs))
    return Adopt(rec.id, obs.pid, obs.pid_start, obs.engine_pid, fields=fields,
                 message=f"adopted running attempt {rec.attempt} (pid {obs.pid})")


def _engine_pid(rec: ReplicaRecord, obs: Observed) -> dict[str, Any]:
    """The engine's pid once the shim reports it (the record got the shim's pid at the start)."""
    if obs.member or not obs.engine_pid or obs.engine_pid == rec.engine_pid:
        return {}
    return {"engine_pid": obs.engine_pid}


def _learned(rec: ReplicaRecord, obs: Observed) -> list[Learned]:
    fields = _engine_pid(rec, obs)
    return [Learned(rec.id, fields=fields)] if fields else []


def _record_exit(rec: ReplicaRecord, obs: Observed, exit: ExitFacts, now: float, policy: Policy) -> RecordExit:
    """The attempt ended, and nobody asked it to: a failure."""
    previous = list(rec.failure_times)
    healthy_for = exit.exited_at - (rec.first_ready_at or exit.exited_at) if ready_this_attempt(rec) else 0.0
    if healthy_for >= policy.backoff_reset:
        previous = []  # a long healthy run ends the streak
    failures, next_at = _next_failure(previous, exit.exited_at, policy)
    restarts = rec.restarts + 1
    fields = {**_exit_fields(rec, exit), "failure_times": list(failures), "next_restart_at": next_at,
              "restarts": restarts}
    reason = obs.term_reason
    where = f"; engine log: {rec.log_path}" if rec.log_path else ""
    message = (f"attempt {rec.attempt} ended unexpectedly: {describe_exit(exit.exit_code, exit.exit_signal)}"
               f"{f' ({reason})' if reason else ''}{where}; restart in {max(0.0, next_at - now):.1f}s")
    return RecordExit(rec.id, exit, failures, next_at, restarts, reason, fields=fields,
                      tail=f"\n[llmgw-agent] terminated: {reason}\n" if reason else "",
                      message=message, level=logging.WARNING)


def _mark_stopped(rec: ReplicaRecord, exit: ExitFacts | None, now: float, node: str) -> MarkStopped:
    fields: dict[str, Any] = {"stopped_at": now}
    if exit is not None:
        fields.update(_exit_fields(rec, exit))
    elif rec.running:
        fields["exited_at"] = now
    # Each node confirms its own part (its own field: no race between the agents); a multi-node
    # replica is Stopped, and its GPUs free, once every node has.
    confirm = {replica_stopped_on(node): now} if len(rec.all_nodes) > 1 else {}
    return MarkStopped(rec.id, exit, now, fields=fields, confirm=confirm,
                       tail="" if rec.started_at is not None else None, message="stopped")


# --- one pass ----------------------------------------------------------------------------------------
def decide(
    records: list[ReplicaRecord],
    observed: dict[str, Observed],
    orphans: list[Orphan],
    now: float,
    policy: Policy = Policy(),
    node: str = "",
) -> list[Action]:
    """Every action for this pass. `records` are this node's records (for a multi-node replica's
    member part, the view `part_view` returns); `node` is this node's name."""
    actions: list[Action] = []
    for rec in records:
        actions += decide_one(rec, observed.get(rec.id, Observed()), now, policy, node)
    for o in orphans:
        actions += stop_signals(o.replica_id, o.pid, o.pid_start, o.term_sent_at, now, policy,
                                "its replica record was deleted", orphan=True)
    return actions


def remember(memory: Attempt | None, action: Action, now: float) -> Attempt | None:
    """This agent's memory of an attempt after applying `action` (None: the attempt is over)."""
    if isinstance(action, (RecordExit, Rejoin, MarkStopped, LaunchFailed)):
        return None
    memory = memory or Attempt()
    if isinstance(action, Probed):
        return dataclasses.replace(memory, last_probe_at=now, probe_failures=action.probe_failures,
                                   last_ok_at=now if action.ok else memory.last_ok_at)
    if isinstance(action, Adopt):
        return dataclasses.replace(memory, known=True, last_ok_at=now)
    if isinstance(action, Signal) and action.sig == signal.SIGTERM and not action.orphan:
        return dataclasses.replace(memory, term_sent_at=now, term_reason=action.reason)
    return memory


# --- what other parts hear of it ---------------------------------------------------------------------
@dataclass(frozen=True)
class News:
    """An event for the history (`llmgw.state.events`) and the control passes to kick at once."""

    kind: str
    message: str
    kicks: tuple[str, ...] = ()


def news(rec: ReplicaRecord, action: Action, crash: CrashPolicy = CrashPolicy()) -> list[News]:
    """What an applied action tells the rest of llmgw (`rec`: the part's view before the action). A
    replica turning Ready or unhealthy changes what is routable (publish now); an exit, a failed
    launch or a confirmed stop changes what should run (reconcile now: restart elsewhere, delete the
    record, place what waited for its GPUs)."""
    if isinstance(action, Probed):
        if action.became_ready:
            return [News("replica_ready", f"Ready at {rec.url} (attempt {rec.attempt})", (PUBLISH,))]
        if "last_probe_ok" in action.fields and action.fields["last_probe_ok"] != rec.last_probe_ok \
                and ready_this_attempt(rec):
            if action.ok:
                return [News("replica_ready", "healthy again", (PUBLISH,))]
            return [News("replica_unhealthy", action.fields.get("probe_error") or "health probe failing", (PUBLISH,))]
        return []
    if isinstance(action, RecordExit):
        how = describe_exit(action.exit.exit_code, action.exit.exit_signal)
        how += (f" ({action.reason})" if action.reason else "") + (f"; engine log: {rec.log_path}" if rec.log_path else "")
        out = [News("replica_failed", f"attempt {rec.attempt} {how}", (PUBLISH, RECONCILE))]
        recent = sum(1 for t in action.failure_times if action.exit.exited_at - t <= crash.window)
        if recent >= crash.max_failures:
            out.append(News("replica_crashloop", f"{recent} failures in {crash.window:g}s; last {how}"))
        return out
    if isinstance(action, LaunchFailed):
        return [News("replica_failed", f"attempt {action.attempt} could not start: {action.reason}", (RECONCILE,))]
    if isinstance(action, Start) and action.restart:
        return [News("replica_restarted", f"attempt {action.attempt}")]
    if isinstance(action, MarkStopped):
        return [News("replica_stopped", rec.stop_reason or "stopped", (RECONCILE,))]
    if isinstance(action, Adopt):
        return [News("replica_adopted", f"attempt {rec.attempt} adopted by a restarted agent (pid {action.pid})")]
    return []


# --- a member part's view ----------------------------------------------------------------------------
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


# --- what is left of deleted replicas ---------------------------------------------------------------
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
