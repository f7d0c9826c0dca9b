"""Stopping this node's engines when the agent stops (unless LLMGW_AGENT_KEEP_ENGINES): the
supervisor's one escalation (SIGTERM, then SIGKILL once the grace period is over) for every running
attempt, then their exits recorded (not as failures: the next agent starts them again at once)."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Any, Callable

from llmgw.state.clock import Clock
from llmgw.state.records import ReplicaRecord
from workers.agent import supervisor as sv

log = logging.getLogger("llmgw.agent")


# replica id -> (its part's view, or None for an attempt only the state dir lists; attempt, pid, pid_start)
Running = dict[str, tuple[ReplicaRecord | None, int, int, int | None]]


@dataclass(frozen=True)
class Shutdown:
    """What stopping this node's engines needs of the agent."""

    node: str
    runner: Any  # the process seam (workers.agent.runner)
    # This node's records as its parts see them, given the attempts the state dir lists (`Observer.part_views`).
    views: Callable[[dict[str, sv.Found], float], list[ReplicaRecord]]
    record: Callable[[list[tuple[ReplicaRecord, sv.Facts]]], object]  # the one write (`Recorder.record`)
    policy: sv.Policy
    clock: Clock
    sleep: Callable[[float], object]  # waits between signals (a fake clock's `sleep` advances it)


def stop_engines(sd: Shutdown) -> None:
    running = _running(sd)
    exits = _escalate(sd, running)
    now = sd.clock.time()
    facts: list[tuple[ReplicaRecord, sv.Facts]] = []
    for rid, (rec, attempt, pid, start) in running.items():
        if rec is not None and rec.node == sd.node:
            exit = exits[rid] if rid in exits else sd.runner.observe(rid, attempt, pid, start).exit
            facts.append((rec, sv.shutdown_exit(rec, exit, now)))
    try:
        sd.record(facts)
    except Exception:  # noqa: BLE001
        log.exception("cannot record the shutdown of %s", ", ".join(sorted(rec.id for rec, _f in facts)))
    log.info("agent stopped %d engine(s)", len(running))


def _running(sd: Shutdown) -> Running:
    """Every attempt running on this node: those the records name, then those only the state dir lists."""
    now = sd.clock.time()
    found = sd.runner.discover()
    try:
        records = sd.views(found, now)
    except Exception:  # noqa: BLE001 - Redis gone: fall back to the state dir
        log.exception("cannot read the replica records; stopping what the state dir lists")
        records = []
    running: Running = {}
    for rec in records:
        if rec.running:
            seen = sd.runner.observe(rec.id, rec.attempt, rec.pid, rec.pid_start)
            if seen.alive and seen.pid:
                running[rec.id] = (rec, rec.attempt, seen.pid, seen.pid_start)
    for rid, f in found.items():
        if f.alive and rid not in running:
            running[rid] = (None, f.attempt, f.pid, f.pid_start)
    return running


def _escalate(sd: Shutdown, running: Running) -> dict[str, sv.ExitFacts | None]:
    """Signal until every attempt is gone (or SIGKILL's own wait is over); how each one ended."""
    policy = sd.policy
    terms: dict[str, float] = {}
    exits: dict[str, sv.ExitFacts | None] = {}
    pending = dict(running)
    give_up = sd.clock.monotonic() + policy.stop_grace + 5.0  # SIGKILL's own wait, bounded
    while pending:
        t = sd.clock.monotonic()
        for rid, (_rec, attempt, pid, start) in list(pending.items()):
            for sig in sv.stop_signals(rid, pid, start, terms.get(rid), t, policy, "the agent is stopping"):
                if sig.sig == signal.SIGKILL:
                    log.warning("replica %s: still running after %.0fs; SIGKILL", rid, policy.stop_grace)
                sd.runner.signal(rid, pid, start, sig.sig)
                terms.setdefault(rid, t)
            seen = sd.runner.observe(rid, attempt, pid, start)
            if not seen.alive:
                exits[rid] = seen.exit
                del pending[rid]
        if pending and sd.clock.monotonic() < give_up:
            sd.sleep(0.1)
        elif pending:
            log.error("engines still running after SIGKILL: %s", ", ".join(sorted(pending)))
            break
    return exits
