"""Stopping this node's engines when the agent stops (unless LLMGW_AGENT_KEEP_ENGINES): the
supervisor's one escalation (SIGTERM, then SIGKILL once the grace period is over) for every running
attempt, then their exits recorded (not as failures: the next agent starts them again at once)."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from llmgw.state.records import ReplicaRecord
from workers.agent import supervisor as sv

if TYPE_CHECKING:
    from workers.agent.loop import Agent

log = logging.getLogger("llmgw.agent")


# replica id -> (its part's view, or None for an attempt only the state dir lists; attempt, pid, pid_start)
Running = dict[str, tuple[ReplicaRecord | None, int, int, int | None]]


def stop_engines(agent: Agent) -> None:
    running = _running(agent)
    exits = _escalate(agent, running)
    now = agent.clock.time()
    facts: list[tuple[ReplicaRecord, sv.Facts]] = []
    for rid, (rec, attempt, pid, start) in running.items():
        if rec is not None and rec.node == agent.node:
            exit = exits[rid] if rid in exits else agent.runner.observe(rid, attempt, pid, start).exit
            facts.append((rec, sv.shutdown_exit(rec, exit, now)))
    try:
        agent.record(facts)
    except Exception:  # noqa: BLE001
        log.exception("cannot record the shutdown of %s", ", ".join(sorted(rec.id for rec, _f in facts)))
    log.info("agent stopped %d engine(s)", len(running))


def _running(agent: Agent) -> Running:
    """Every attempt running on this node: those the records name, then those only the state dir lists."""
    now = agent.clock.time()
    found = agent.runner.discover()
    try:
        records = [sv.part_view(r, agent.members.get(r.id, {}), found.get(r.id), agent.node, now)[0]
                   for r in agent.store.replicas_on(agent.node)]
    except Exception:  # noqa: BLE001 - Redis gone: fall back to the state dir
        log.exception("cannot read the replica records; stopping what the state dir lists")
        records = []
    running: Running = {}
    for rec in records:
        if rec.running:
            seen = agent.runner.observe(rec.id, rec.attempt, rec.pid, rec.pid_start)
            if seen.alive and seen.pid:
                running[rec.id] = (rec, rec.attempt, seen.pid, seen.pid_start)
    for rid, f in found.items():
        if f.alive and rid not in running:
            running[rid] = (None, f.attempt, f.pid, f.pid_start)
    return running


def _escalate(agent: Agent, running: Running) -> dict[str, sv.ExitFacts | None]:
    """Signal until every attempt is gone (or SIGKILL's own wait is over); how each one ended."""
    policy = agent.policy
    terms: dict[str, float] = {}
    exits: dict[str, sv.ExitFacts | None] = {}
    pending = dict(running)
    give_up = agent.clock.monotonic() + policy.stop_grace + 5.0  # SIGKILL's own wait, bounded
    while pending:
        t = agent.clock.monotonic()
        for rid, (_rec, attempt, pid, start) in list(pending.items()):
            for s in sv.stop_signals(rid, pid, start, terms.get(rid), t, policy, "the agent is stopping"):
                if s.sig == signal.SIGKILL:
                    log.warning("replica %s: still running after %.0fs; SIGKILL", rid, policy.stop_grace)
                agent.runner.signal(rid, pid, start, s.sig)
                terms.setdefault(rid, t)
            seen = agent.runner.observe(rid, attempt, pid, start)
            if not seen.alive:
                exits[rid] = seen.exit
                del pending[rid]
        if pending and agent.clock.monotonic() < give_up:
            agent.sleep(0.1)
        elif pending:
            log.error("engines still running after SIGKILL: %s", ", ".join(sorted(pending)))
            break
    return exits
