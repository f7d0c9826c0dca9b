"""`decide(records, observed, orphans, now, policy, node) -> [Action]`: every rule for one pass, and
`remember`, the agent's memory of an attempt after an action."""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import Any

from llmgw.proc.exitstatus import describe_exit
from llmgw.state.records import ReplicaRecord
from workers.agent.supervisor import parts, probes, weights
from workers.agent.supervisor.actions import (
    Action,
    Adopt,
    CancelFetch,
    Drained,
    LaunchFailed,
    Learned,
    MarkStopped,
    Probed,
    RecordExit,
    Rejoin,
    Signal,
    Start,
    WeightsLocal,
)
from workers.agent.supervisor.observed import Attempt, ExitFacts, Observed, Orphan
from workers.agent.supervisor.policy import Policy, next_failure
from workers.agent.supervisor.rules import exit_fields, ready_this_attempt, stop_signals


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


def decide_one(rec: ReplicaRecord, obs: Observed, now: float, policy: Policy, node: str = "") -> list[Action]:
    """The actions for one replica; `rec` is the view of this node's part (see `part_view`)."""
    actions: list[Action] = []
    if obs.probe_ok is not None:
        # The rest of the pass sees the record as this probe leaves it (e.g. just Ready).
        outcome = probes.probed(rec, obs.probe_failures, obs.probe_ok, obs.probe_error, now, policy)
        actions.append(outcome)
        rec = dataclasses.replace(rec, **outcome.fields)
    return actions + _decide(rec, obs, now, policy, node)


def _decide(rec: ReplicaRecord, obs: Observed, now: float, policy: Policy, node: str) -> list[Action]:
    rid = rec.id
    if rec.stop_requested_at is not None:
        if obs.fetch is not None:
            return [CancelFetch(rid), *_decide(rec, dataclasses.replace(obs, fetch=None), now, policy, node)]
        if rec.stopped_at is not None:
            return []
        if obs.alive:
            learned: list[Action] = list(_learned(rec, obs))
            drain = obs.drain
            if obs.term_sent_at is None and drain is not None:
                if not drain.done:
                    return learned  # still serving what it was given; nothing new reaches it
                if not obs.member and rec.drained_at is None:  # a member part waits for its head's drain
                    learned.append(Drained(rid, fields={"drained_at": now, "drain_note": drain.note},
                                           message=f"drain over: {drain.note}"))
            return learned + _terminate(rid, obs, now, policy, f"stop requested: {rec.stop_reason or 'no reason'}")
        return [_mark_stopped(rec, obs.exit, now, node)]

    if obs.alive:
        if not obs.known:
            # Adopt first; judge its health from the next pass on, with probes of our own.
            return [_adopt(rec, obs, now)]
        learned = _learned(rec, obs)
        leaving = parts.leave_stale(rec, obs, now, policy)
        if leaving is not None:
            return learned + leaving
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
        ended = parts.part_ended(rec, obs, exit, now, policy)
        return ended if ended is not None else [_record_exit(rec, obs, exit, now, policy)]

    if weights.needs_weights(rec, obs):
        # Its weights first (a member part too, without waiting for its head): `weights.fetch_step`.
        step = weights.fetch_step(rec, obs, now, policy)
        local = next((a for a in step if isinstance(a, WeightsLocal)), None)
        if local is None:
            return step
        return step + _start(dataclasses.replace(rec, **local.fields), obs, now)
    return _start(rec, obs, now)


def _start(rec: ReplicaRecord, obs: Observed, now: float) -> list[Action]:
    if obs.member and not obs.head_attempt:
        return []  # a member part joins a running head attempt only (it needs the head's rendezvous)
    if rec.next_restart_at is None or now >= rec.next_restart_at:
        path = rec.weights_path if obs.weights_source is not None else None
        return [Start(rec.id, rec.attempt + 1, restart=rec.attempt > 0, head_attempt=obs.head_attempt,
                      weights_path=path)]
    return []


def _terminate(rid: str, obs: Observed, now: float, policy: Policy, reason: str) -> list[Signal]:
    return stop_signals(rid, obs.pid, obs.pid_start, obs.term_sent_at, now, policy, reason)


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
    failures, next_at = next_failure(previous, exit.exited_at, policy)
    restarts = rec.restarts + 1
    fields = {**exit_fields(rec, exit), "failure_times": list(failures), "next_restart_at": next_at,
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
        fields.update(exit_fields(rec, exit))
    elif rec.running:
        fields["exited_at"] = now
    return MarkStopped(rec.id, exit, now, fields=fields, confirm=parts.stop_confirmation(rec, node, now),
                       tail="" if rec.started_at is not None else None, message="stopped")


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
