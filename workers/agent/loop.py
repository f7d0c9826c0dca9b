"""The node agent: a level-based loop that turns this node's replica records into serving processes.

Each pass (`Agent.tick`) observes, decides and acts:
1. observe: the records on this node (one read), the attempts in the state dir (one look), each
   running attempt's process (the runner seam) and the `/health` probes `supervisor.due_probes` says
   are due (the prober seam, concurrently);
2. decide: `workers.agent.supervisor.decide` returns the actions, each carrying the facts to record;
   the launcher builds each Start's command and port, whose intent (`supervisor.starting`) is a fact too;
3. act: `supervisor.merge` gathers the pass's facts per replica and every record is written once, in
   one pipeline (a member part of a multi-node replica keeps its facts in this agent's memory; only the
   head writes the record's agent fields), then the signals and spawns. A started replica's shim pid
   is the one later write: its intent must be in Redis before the process exists, and the pid exists
   only after.
The LoRA adapters of Ready replicas (`workers.agent.adapterkeeper`) add their facts to that one write and
make their engine calls after it, off the loop's thread.
The loop never dies: a replica that cannot be observed or acted on is logged with its id and skipped.
Launches are built in `launch.py`; the loop's thread, the heartbeat's and the scraper's are run by
`step.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from llmgw.engines import get_engine
from llmgw.proc.ports import can_bind
from llmgw.state.clock import Clock
from llmgw.state.node_records import GPUDevice
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import drain_progress, head_drained
from llmgw.state.store import Store
from llmgw.tracing import OFF
from workers.agent import supervisor as sv
from workers.agent.adapterkeeper import AdapterKeeper
from workers.agent.config import AgentSettings
from workers.agent.inventory import core_ids, node_info
from workers.agent.launch import CatalogCache, Launch, Launcher, launch_span, ready_span
from workers.agent.scrape import ScrapeTarget, scrape_targets
from workers.agent.shutdown import stop_engines
from workers.agent.weights import NodeWeights

log = logging.getLogger("llmgw.agent")


@dataclass
class Local:
    """This agent's memory of one replica's current attempt, and its launch once known."""

    memory: sv.Attempt
    launch: Launch | None = None


class Prepared(NamedTuple):
    """A Start whose launch is built: `intent`, the facts recorded before its process is spawned."""

    rec: ReplicaRecord
    start: sv.Start
    launch: Launch
    intent: dict[str, Any]


class Agent:
    def __init__(self, settings: AgentSettings, store: Store, runner: Any, prober: Any, clock: Clock | None = None,
                 gpus: tuple[GPUDevice, ...] = (), bindable=None, sleep=None,
                 kick: Callable[[str], object] = lambda task: None, weights: NodeWeights | None = None,
                 gpu_health: Any = None, tracing: Any = None, cores: tuple[int, ...] | None = None):
        self.settings, self.store, self.runner, self.prober = settings, store, runner, prober
        self.tracing = tracing if tracing is not None else OFF  # llmgw.tracing: each launch is a span
        self.kick = kick  # tells the control plane a fact changed (llmgw.state.kicks)
        self.clock = clock or Clock()
        # Waiting during shutdown goes through the clock too (a fake clock's `sleep` advances it).
        self.sleep = sleep or getattr(self.clock, "sleep", None) or time.sleep
        self.gpus = gpus
        self.node = settings.node_name
        self.policy = settings.policy
        self.catalog = CatalogCache(store, self.clock)
        self.launcher = Launcher(settings, store, self.catalog, gpus,
                                 bindable or (lambda port: can_bind(settings.engine_host, port)),
                                 cores=core_ids() if cores is None else cores)
        self.adapters = AdapterKeeper(store, self.catalog, self.node, prober, kick, settings.adapter_timeout,
                                      settings.adapter_unload_grace)
        self.local: dict[str, Local] = {}
        self.members: dict[str, dict] = {}  # facts of multi-node member parts (never in Redis)
        self.orphan_terms: dict[str, float] = {}  # when SIGTERM went to an attempt without a record
        self.started_at = self.clock.time()
        self.targets: list[ScrapeTarget] = []
        self.starting = False  # an attempt is starting: pass again soon (`next_wait`)
        self.stopping = threading.Event()  # set when the agent shuts down (workers.agent.step)
        self._warned: dict[str, float] = {}
        self._probe_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmgw-probe")
        # Downloads, header reads and pulls (workers.agent.weights); GPU health for the heartbeat.
        self.weights = weights or NodeWeights.for_agent(settings, store, kick)
        self.gpu_health = gpu_health

    # --- one pass --------------------------------------------------------------------------------
    def tick(self) -> list[sv.Action]:
        """One pass of the loop. Returns the actions decided (for tests and logs)."""
        now = self.clock.time()
        # observe
        records = self.store.replicas_on(self.node)
        ids = {r.id for r in records}
        for memory in (self.local, self.members):
            for rid in [k for k in memory if k not in ids]:
                del memory[rid]
        self.weights.forget_except(ids)
        found = self.runner.discover()
        views, observed = self._observe(records, found, now)
        rest = self._leftovers(ids, found, now)
        # decide
        actions = sv.decide(views, observed, list(rest.orphans), now, self.policy, self.node)
        # act
        self._act(views, records, actions, now)
        self.starting = any(observed[v.id].alive and observed[v.id].has_health and not sv.ready_this_attempt(v)
                            and v.stop_requested_at is None for v in views)
        for rid in rest.remove:
            log.info("replica %s: removing the files of a deleted replica", rid)
            self.runner.remove(rid)
        self._restore(rest.restore)
        return actions

    # --- observe ---------------------------------------------------------------------------------
    def _observe(self, records: list[ReplicaRecord], found: dict, now: float):
        views, observed = [], {}
        for rec in records:
            try:
                view, facts = sv.part_view(rec, self.members.get(rec.id, {}), found.get(rec.id), self.node, now)
                if facts:
                    self.members[rec.id] = facts
                observed[rec.id] = self._look(view, rec)
                views.append(view)
            except Exception as e:  # noqa: BLE001 - skip it this pass, keep supervising the others
                self.warn(rec.id, f"cannot observe its process, skipped this pass: {e!r}")
        self._probe(views, observed, now)
        self._drains(views, {r.id: r for r in records}, observed, now)
        return views, observed

    def _drains(self, views: list[ReplicaRecord], stored: dict[str, ReplicaRecord],
                observed: dict[str, sv.Observed], now: float) -> None:
        """How far each planned stop's drain has come (docs/lifecycle.md): for a head, from the gateways'
        reports and its engine's last scrape, read once a pass and only while something drains; a
        member part follows its head's record."""
        waiting = [v for v in views if v.stop_requested_at is not None and v.stopped_at is None
                   and observed[v.id].alive and observed[v.id].term_sent_at is None]
        if not waiting:
            return
        heads = [v.id for v in waiting if v.node == self.node and v.drained_at is None]
        gateways = self.store.gateway_reports() if heads else []
        loads = self.store.loads(heads) if heads else {}
        for v in waiting:
            drain = (drain_progress(v, gateways, loads.get(v.id), now) if v.node == self.node
                     else head_drained(stored[v.id], now))
            observed[v.id] = dataclasses.replace(observed[v.id], drain=drain)

    def _look(self, view: ReplicaRecord, stored: ReplicaRecord) -> sv.Observed:
        """What this agent knows of the part's current attempt. `view` is the part's view (see
        `part_view`), `stored` the record as read, whose agent fields are the head's: a member part
        follows the head's attempt."""
        head = view.node == self.node
        member = sv.head_of_part(stored, self.node, self.members.get(view.id, {}))
        loc = self.local.get(view.id)
        if loc is not None and loc.memory.attempt != view.attempt:  # the memory of an earlier attempt
            del self.local[view.id]
            loc = None
        if not view.running:
            return sv.Observed(known=loc is not None and loc.memory.known, **member,
                               **self.weights.observe(view, lambda: self.catalog.lookup(view)))
        seen = self.runner.observe(view.id, view.attempt, view.pid, view.pid_start)
        if loc is None:
            loc = self.local[view.id] = Local(sv.Attempt(attempt=view.attempt))
        if loc.launch is None:
            try:
                loc.launch = self.launcher.rebuild(view)
            except Exception as e:  # noqa: BLE001 - the defaults apply without it
                self.warn(view.id, f"cannot rebuild its launch spec: {e}")
        spec, m = (loc.launch.spec if loc.launch else None), loc.memory
        return sv.Observed(
            alive=seen.alive, exit=seen.exit, known=m.known, pid=seen.pid, pid_start=seen.pid_start,
            engine_pid=seen.engine_pid, term_sent_at=m.term_sent_at, term_reason=m.term_reason,
            last_ok_at=m.last_ok_at, start_timeout=spec.start_timeout if spec else 120.0,
            has_health=head and (spec is None or spec.serves_http), **member,
        )

    def _probe(self, views: list[ReplicaRecord], observed: dict[str, sv.Observed], now: float) -> None:
        """Run the `/health` probes that are due, concurrently; their results go to `observed`."""
        memory = {rid: loc.memory for rid, loc in self.local.items()}
        paths = {rid: loc.launch.spec.health_path for rid, loc in self.local.items() if loc.launch}
        due = sv.due_probes(views, observed, memory, paths, now, self.policy)
        results = self._probe_pool.map(lambda probe: self.prober.health(probe.url, self.settings.probe_timeout), due)
        for probe, res in zip(due, results):
            observed[probe.replica_id] = dataclasses.replace(
                observed[probe.replica_id], probe_ok=res.ok, probe_error=res.error, probe_failures=probe.failures)

    def _leftovers(self, ids: set[str], found: dict, now: float) -> sv.Leftovers:
        self.orphan_terms = {rid: t for rid, t in self.orphan_terms.items() if rid in found and found[rid].alive}
        dirs = {rid: self.runner.last_activity(rid) for rid in self.runner.known_dirs() if rid not in ids}
        applied = self.store.catalog_applied()
        saved = {} if applied else self._saved([rid for rid, f in found.items() if f.alive and rid not in ids])
        rest = sv.leftovers(found, ids, self.orphan_terms, applied, dirs, now, self.settings.dir_retention,
                            saved, self.node)
        if rest.left_alone:
            self.warn("*", f"no catalog in Redis: leaving {rest.left_alone} engine(s) without a record alone")
        return rest

    def _saved(self, rids: list[str]) -> dict[str, ReplicaRecord]:
        """The records these attempts were started with (`runner.save_record`), where readable."""
        out = {}
        for rid in rids:
            data = self.runner.saved_record(rid)
            try:
                if data:
                    out[rid] = ReplicaRecord.from_dict(data)
            except (TypeError, ValueError) as e:
                self.warn(rid, f"its saved record is unreadable ({e}); it cannot be registered again")
        return out

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

    # --- act -------------------------------------------------------------------------------------
    def _act(self, views: list[ReplicaRecord], records: list[ReplicaRecord], actions: list[sv.Action],
             now: float) -> None:
        by_id = {v.id: v for v in views}
        recorded = [a for a in actions if isinstance(a, sv.Facts)]
        launches, failed = self._prepare([a for a in actions if isinstance(a, sv.Start)], by_id, records, now)
        # One write of the pass's facts, the starts' intents included: bookkeeping before side effects.
        intents = [(s.rec, sv.Facts(fields=s.intent)) for s in launches]
        writes, existing = self.record([(by_id[a.replica_id], a) for a in recorded] + intents + failed
                                       + self.adapters.step(views, now))
        # LoRA loads and unloads, once their facts are in. Gone: a record this write found deleted. A
        # replica merged with no field to write was not written, so the write says nothing of it.
        self.adapters.act({rid for rid, fields in writes.records.items() if fields} - existing)
        for action in recorded:
            self._remember(action, now)
        # What the scraper reads: Ready heads, as this pass leaves them.
        heads = [sv.with_fields(v, writes.records.get(v.id, {})) for v in views if v.node == self.node]
        self.targets = scrape_targets(heads, {rid: loc.launch for rid, loc in self.local.items()})
        self.weights.act(actions, views)
        for action in actions:
            if isinstance(action, sv.Signal):
                self._signal(action, now)
        # A head whose record was deleted meanwhile is not started.
        spawned = [(s.rec, self._spawn(s, now)) for s in launches if s.rec.node != self.node or s.rec.id in existing]
        self.record(spawned)
        failed += [(rec, f) for rec, f in spawned if isinstance(f, sv.LaunchFailed)]
        self._announce([*actions, *(f for _rec, f in failed)], by_id)

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
                loc = self.local.get(rec.id)
                ready_span(self.tracing, rec, writes.records[rec.id].get("first_ready_at"), self.node,
                           loc.launch if loc else None)
        for rid, fields in writes.members.items():
            self.members.setdefault(rid, {}).update(fields)
        return writes, self.store.update_replicas(writes.records)

    def _memory_report(self, rid: str) -> str | None:
        """What a just-Ready engine's log says it took (the log's first MiB), for status beside the estimate."""
        loc = self.local.get(rid)
        try:
            with open(self.runner.log_path(rid), errors="replace") as f:
                head = f.read(1 << 20)
            return get_engine(loc.launch.engine).memory_report(head) if loc and loc.launch else None
        except Exception:  # noqa: BLE001 - a report without it
            return None

    def _announce(self, actions: list[sv.Action], by_id: dict[str, ReplicaRecord]) -> None:
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

    def _remember(self, action: sv.Action, now: float) -> None:
        loc = self.local.get(action.replica_id)
        memory = sv.remember(loc.memory if loc else None, action, now)
        if memory is None:
            self.local.pop(action.replica_id, None)
        elif loc is not None:
            loc.memory = memory

    def _signal(self, action: sv.Signal, now: float) -> None:
        log.info("replica %s: sending %s to pid %d: %s", action.replica_id, signal.Signals(action.sig).name,
                 action.pid, action.reason)
        try:
            self.runner.signal(action.replica_id, action.pid, action.pid_start, action.sig)
        except Exception:  # noqa: BLE001
            log.exception("replica %s: signalling pid %d failed", action.replica_id, action.pid)
            return
        if action.orphan and action.sig == signal.SIGTERM:
            self.orphan_terms[action.replica_id] = now
        elif not action.orphan:
            self._remember(action, now)

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
                    leaving_cpus=[c for rid, (c, going) in cpus.items() if rid != rec.id and going])
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
        self.local[rec.id] = Local(sv.Attempt(attempt=start.attempt, known=True), dataclasses.replace(launch, spec=spec))
        if start.weights_path:
            self.weights.started(rec, now)
        try:
            if rec.node == self.node:  # the record it starts with, kept beside it (supervisor.restored)
                self.runner.save_record(rec.id, sv.with_fields(rec, prepared.intent).to_dict())
            pid, pid_start = self.runner.spawn(rec.id, start.attempt, spec)
        except Exception as e:  # noqa: BLE001
            self.local.pop(rec.id, None)
            span.fail(f"cannot start the shim: {e}")
            span.end()
            return sv.launch_failed(rec, start.attempt, now, f"cannot start the shim: {e}", self.policy)
        span.set("process.pid", pid)
        span.end()
        log.info("replica %s: %s attempt %d on port %d (pid %d): %s", rec.id,
                 "restarting," if start.restart else "starting,", start.attempt, launch.port, pid,
                 " ".join(launch.spec.argv))
        return sv.Facts(fields={"pid": pid, "pid_start": pid_start})

    def next_wait(self) -> float:
        """How long the loop may wait for a wake-up before the next pass."""
        return min(self.settings.tick, self.settings.start_probe_interval) if self.starting else self.settings.tick

    def warn(self, key: str, text: str, interval: float = 60.0) -> None:
        """Log a repeated condition at most once a minute."""
        now = self.clock.monotonic()
        if now - self._warned.get(key + text, -1e18) >= interval:
            if len(self._warned) > 1000:
                self._warned.clear()
            self._warned[key + text] = now
            log.warning("%s", text if key == "*" else f"replica {key}: {text}")

    # --- heartbeat and shutdown ------------------------------------------------------------------
    def close(self) -> None:
        self._probe_pool.shutdown(wait=False)
        self.weights.close()
        self.adapters.close()

    def heartbeat(self) -> None:
        now = self.clock.time()
        gpus = self.gpu_health.step(self.gpus, now) if self.gpu_health is not None else self.gpus
        info = node_info(self.settings, gpus, self.started_at, now, self.weights.report())
        self.store.write_heartbeat(info, self.settings.heartbeat_ttl)

    def weights_pass(self) -> None:
        """Read the headers placement waits for, and serve `llmgw models pull` (its own thread)."""
        self.weights.side_pass(self.catalog.get())

    def stop_engines(self) -> None:
        """Stop every engine on this node and record the exits (workers.agent.shutdown)."""
        stop_engines(self)
