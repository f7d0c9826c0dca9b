"""What one node agent pass does with the actions `supervisor.decide` returned.

`supervisor.merge` gathers the pass's facts per replica and every record is written once, in one
pipeline (the starts' intents, `supervisor.starting`, included: bookkeeping before side effects);
then the LoRA adapters' engine calls, the signals and the spawns. A started replica's shim pid is the
one later write: its intent must be in Redis before the process exists, and the pid exists only
after. Last, the news of what was applied, and what is left without a record: files of deleted
replicas removed, running engines registered again after Redis lost their records.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from typing import Any, Callable, NamedTuple

from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store
from workers.agent import supervisor as sv
from workers.agent.adapterkeeper import AdapterKeeper
from workers.agent.launch import Launch, Launcher, launch_span
from workers.agent.memory import Local, Memory
from workers.agent.observe import Observation
from workers.agent.record import Recorder
from workers.agent.scrape import ScrapeTarget, scrape_targets
from workers.agent.weights import NodeWeights

log = logging.getLogger("llmgw.agent")


class Prepared(NamedTuple):
    """A Start whose launch is built: `intent`, the facts recorded before its process is spawned."""

    rec: ReplicaRecord
    start: sv.Start
    launch: Launch
    intent: dict[str, Any]


class Actor:
    def __init__(self, node: str, store: Store, runner: Any, launcher: Launcher, recorder: Recorder,
                 adapters: AdapterKeeper, weights: NodeWeights, memory: Memory, policy: sv.Policy, tracing: Any,
                 stopping: threading.Event, warn: Callable[..., None]):
        self.node, self.store, self.runner, self.launcher, self.recorder = node, store, runner, launcher, recorder
        self.adapters, self.weights, self.memory, self.policy = adapters, weights, memory, policy
        self.tracing = tracing  # llmgw.tracing: each launch is a span
        self.stopping = stopping  # set when the agent shuts down: no more starts
        self.warn = warn
        # What the scraper reads (`scrape.Scraper`): Ready heads, as the last pass left them.
        self.targets: list[ScrapeTarget] = []

    def act(self, seen: Observation, actions: list[sv.Action], now: float) -> None:
        views = seen.views
        by_id = {v.id: v for v in views}
        recorded = [a for a in actions if isinstance(a, sv.Facts)]
        launches, failed = self._prepare([a for a in actions if isinstance(a, sv.Start)], by_id, seen.records, now)
        # One write of the pass's facts, the starts' intents included: bookkeeping before side effects.
        intents = [(s.rec, sv.Facts(fields=s.intent)) for s in launches]
        writes, existing = self.recorder.record([(by_id[a.replica_id], a) for a in recorded] + intents + failed
                                                + self.adapters.step(views, now))
        # LoRA loads and unloads, once their facts are in. Gone: a record this write found deleted. A
        # replica merged with no field to write was not written, so the write says nothing of it.
        self.adapters.act({rid for rid, fields in writes.records.items() if fields} - existing)
        for action in recorded:
            self.memory.remember(action, now)
        heads = [sv.with_fields(v, writes.records.get(v.id, {})) for v in views if v.node == self.node]
        self.targets = scrape_targets(heads, self.memory.launches())
        self.weights.act(actions, views)
        for action in actions:
            if isinstance(action, sv.Signal):
                self._signal(action, now)
        # A head whose record was deleted meanwhile is not started.
        spawned = [(s.rec, self._spawn(s, now)) for s in launches if s.rec.node != self.node or s.rec.id in existing]
        self.recorder.record(spawned)
        failed += [(rec, f) for rec, f in spawned if isinstance(f, sv.LaunchFailed)]
        self.recorder.announce([*actions, *(f for _rec, f in failed)], by_id)
        for rid in seen.rest.remove:
            log.info("replica %s: removing the files of a deleted replica", rid)
            self.runner.remove(rid)
        self._restore(seen.rest.restore)

    def _signal(self, action: sv.Signal, now: float) -> None:
        log.info("replica %s: sending %s to pid %d: %s", action.replica_id, signal.Signals(action.sig).name,
                 action.pid, action.reason)
        try:
            self.runner.signal(action.replica_id, action.pid, action.pid_start, action.sig)
        except Exception:  # noqa: BLE001
            log.exception("replica %s: signalling pid %d failed", action.replica_id, action.pid)
            return
        if action.orphan and action.sig == signal.SIGTERM:
            self.memory.orphan_terms[action.replica_id] = now
        elif not action.orphan:
            self.memory.remember(action, now)

    def _prepare(self, starts: list[sv.Start], by_id: dict[str, ReplicaRecord], records: list[ReplicaRecord],
                 now: float) -> tuple[list[Prepared], list[tuple[ReplicaRecord, sv.Facts]]]:
        """Each Start's port and command with the intent to record before its spawn; a launch that cannot
        even be built is a failed attempt (its facts are the second list)."""
        # Ports held by any record on this node, including this agent's member parts.
        reserved = ({r.port for r in records if r.port} | {v.port for v in by_id.values() if v.port}
                    | {p for r in records if r.node == self.node
                       for p in (r.master_port, r.kv_events_port, r.kv_replay_port) if p})
        # Cores held by the CPU replicas on this node (each start below avoids the others').
        # A record whose stop was asked for still runs while it drains, but goes: its cores count last.
        cpus = {r.id: (tuple(r.cpus), r.stop_requested_at is not None)
                for r in records if r.node == self.node and r.cpus and r.stopped_at is None}
        ready, failed = [], []
        for start in starts:
            if self.stopping.is_set():
                break  # shutting down: stop_engines() may already have made its list
            rec = by_id[start.replica_id]
            try:
                launch = self.launcher.prepare(
                    rec, reserved, start.weights_path,
                    held_cpus=[c for rid, (c, going) in cpus.items() if rid != rec.id and not going],
                    leaving_cpus=[c for rid, (c, going) in cpus.items() if rid != rec.id and going],
                    neighbours=self.launcher.neighbours(rec, records))
            except Exception as e:  # noqa: BLE001 - e.g. no free port, an engine binary missing
                failed.append((rec, sv.launch_failed(rec, start.attempt, now, f"cannot build the launch: {e}",
                                                     self.policy)))
                continue
            if launch is None:
                self.warn(rec.id, f"model {rec.model!r} profile {rec.profile!r} is not in the applied catalog; "
                                   "not starting")
                continue
            reserved |= launch.ports
            if launch.cpus:
                cpus[rec.id] = (launch.cpus, False)
            intent = sv.starting(rec, start, now, launch.port, launch.url, launch.master_port,
                                 launch.spec.serves_http, log_path=str(self.runner.log_path(rec.id)),
                                 kv_ports=launch.kv_ports, cpus=launch.cpus)
            ready.append(Prepared(rec, start, launch, intent))
        return ready, failed

    def _spawn(self, prepared: Prepared, now: float) -> sv.Facts:
        """Spawn an attempt whose intent is recorded; the facts of how that went (its pid, or a failure)."""
        rec, start, launch = prepared.rec, prepared.start, prepared.launch
        span, spec = launch_span(self.tracing, rec, start.attempt, self.node, launch.spec)
        # Kept with the traced spec: its TRACEPARENT is the parent of the engine's start (`ready_span`).
        self.memory.local[rec.id] = Local(sv.Attempt(attempt=start.attempt, known=True),
                                          dataclasses.replace(launch, spec=spec))
        if start.weights_path:
            self.weights.started(rec, now)
        try:
            if rec.node == self.node:  # the record it starts with, kept beside it (supervisor.restored)
                self.runner.save_record(rec.id, sv.with_fields(rec, prepared.intent).to_dict())
            pid, pid_start = self.runner.spawn(rec.id, start.attempt, spec)
        except Exception as e:  # noqa: BLE001
            self.memory.local.pop(rec.id, None)
            span.fail(f"cannot start the shim: {e}")
            span.end()
            return sv.launch_failed(rec, start.attempt, now, f"cannot start the shim: {e}", self.policy)
        span.set("process.pid", pid)
        span.end()
        log.info("replica %s: %s attempt %d on port %d (pid %d): %s", rec.id,
                 "restarting," if start.restart else "starting,", start.attempt, launch.port, pid,
                 " ".join(launch.spec.argv))
        return sv.Facts(fields={"pid": pid, "pid_start": pid_start})

    def _restore(self, records: tuple[ReplicaRecord, ...]) -> None:
        """Register running engines again after Redis lost their records (and the catalog)."""
        for rec in records:
            try:
                if not self.store.restore_replica(rec):
                    continue  # a record with this id appeared meanwhile: it is the truth
            except Exception:  # noqa: BLE001 - the next pass tries again
                log.exception("replica %s: registering the running engine again failed", rec.id)
                continue
            log.warning("replica %s: Redis holds neither its record nor a catalog (it lost its data?): "
                        "registered the running engine (attempt %d, pid %s) again from its state dir; "
                        "re-apply the catalog with `llmgw catalog apply FILE`", rec.id, rec.attempt, rec.pid)
            self.store.emit("replica_adopted", "registered again by its node agent after Redis lost its record",
                            source=f"agent:{self.node}", model=rec.model, profile=rec.profile, node=self.node,
                            replica=rec.id)
