"""How a node agent's facts reach Redis: merged per replica and written once, in one pipeline
(`supervisor.merge`; a member part's facts stay in the agent's memory, only the head writes the
record's agent fields); then the news of what was applied (events, and kicks for the control passes
a fact concerns). Used by each pass and by the shutdown."""

from __future__ import annotations

import logging
from typing import Any, Callable

from llmgw.engines import get_engine
from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store
from workers.agent import supervisor as sv
from workers.agent.launch import ready_span
from workers.agent.memory import Memory

log = logging.getLogger("llmgw.agent")


class Recorder:
    def __init__(self, node: str, store: Store, runner: Any, memory: Memory, tracing: Any,
                 kick: Callable[[str], object]):
        self.node, self.store, self.runner, self.memory = node, store, runner, memory
        self.tracing = tracing  # llmgw.tracing: a replica's first Ready ends its launch's trace
        self.kick = kick  # tells the control plane a fact changed (llmgw.state.kicks)

    def record(self, facts: list[tuple[ReplicaRecord, sv.Facts]]) -> tuple[sv.Writes, set[str]]:
        """Record `facts`: merged per replica, each record written once (one pipeline), a member part's
        facts kept in this agent's memory. Returns the writes and the ids whose record still exists."""
        tails: dict[str, str] = {}
        for rec, facts_ in facts:
            if facts_.tail is not None and rec.id not in tails:
                try:
                    tails[rec.id] = self.runner.log_tail(rec.id, sv.LOG_TAIL_BYTES)
                except Exception:  # noqa: BLE001 - the facts are recorded without the log's end
                    log.exception("replica %s: cannot read the end of its engine log", rec.id)
            if facts_.message:
                log.log(facts_.level, "replica %s: %s", rec.id, facts_.message)
        writes = sv.merge(facts, self.node, tails)
        for rec, facts_ in facts:
            if isinstance(facts_, sv.Probed) and facts_.became_ready and rec.id in writes.records:
                memory = self._memory_report(rec.id)
                if memory:
                    writes.records[rec.id]["engine_memory"] = memory
                ready_span(self.tracing, rec, writes.records[rec.id].get("first_ready_at"), self.node,
                           self.memory.launch(rec.id))
        for rid, fields in writes.members.items():
            self.memory.members.setdefault(rid, {}).update(fields)
        return writes, self.store.update_replicas(writes.records)

    def _memory_report(self, rid: str) -> str | None:
        """What a just-Ready engine's log says it took (the log's first MiB), for status beside the estimate."""
        launch = self.memory.launch(rid)
        try:
            with open(self.runner.log_path(rid), errors="replace") as f:
                head = f.read(1 << 20)
            return get_engine(launch.engine).memory_report(head) if launch else None
        except Exception:  # noqa: BLE001 - a report without it
            return None

    def announce(self, actions: list[sv.Action], by_id: dict[str, ReplicaRecord]) -> None:
        """Events for the history, and kicks for the control passes a fact concerns (after the facts
        are in Redis, so the pass they start reads them)."""
        kicks: set[str] = set()
        for action in actions:
            rec = by_id.get(action.replica_id)
            if rec is None:
                continue  # an orphan: no record to speak of
            for n in sv.news(rec, action):
                self.store.emit(n.kind, n.message, source=f"agent:{self.node}", model=rec.model,
                                profile=rec.profile, node=self.node, replica=rec.id)
                kicks.update(n.kicks)
        for task in sorted(kicks):
            self.kick(task)
