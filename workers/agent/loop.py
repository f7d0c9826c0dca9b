"""The node agent: a level-based loop that turns this node's replica records into serving processes.

Each pass (`Agent.tick`) observes, decides and acts:
1. observe: the records on this node (one read), the attempts in the state dir (one look), each
   running attempt's process (the runner seam) and, where one is due, its `/health` (the prober seam,
   concurrently);
2. decide: `workers.agent.supervisor.decide` returns the actions, each carrying the fields to record;
3. act: every replica's fields go to Redis in one pipeline (a member part of a multi-node replica keeps
   its facts in this agent's memory; only the head writes the record's agent fields), then the
   signals and spawns. A started replica's shim pid is the one later write: its intent must be in
   Redis before the process exists, and the pid exists only after.
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
from typing import Any, Callable

from llmgw.proc.ports import can_bind
from llmgw.state.clock import Clock
from llmgw.state.records import GPUDevice, ReplicaRecord
from llmgw.state.replica_state import drain_progress, head_drained
from llmgw.state.store import Store
from workers.agent import supervisor as sv
from workers.agent.config import AgentSettings
from workers.agent.inventory import node_info
from workers.agent.launch import CatalogCache, Launch, Launcher
from workers.agent.scrape import ScrapeTarget, scrape_targets

log = logging.getLogger("llmgw.agent")

_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(ReplicaRecord))


@dataclass
class Local:
    """This agent's memory of one replica's current attempt, and its launch once known."""

    memory: sv.Attempt
    launch: Launch | None = None


class Agent:
    def __init__(self, settings: AgentSettings, store: Store, runner: Any, prober: Any, clock: Clock | None = None,
                 gpus: tuple[GPUDevice, ...] = (), bindable=None, sleep=None,
                 kick: Callable[[str], object] = lambda task: None):
        self.settings, self.store, self.runner, self.prober = settings, store, runner, prober
        self.kick = kick  # tells the control plane a fact changed (llmgw.state.kicks)
        self.clock = clock or Clock()
        # Waiting during shutdown goes through the clock too (a fake clock's `sleep` advances it).
        self.sleep = sleep or getattr(self.clock, "sleep", None) or time.sleep
        self.gpus = gpus
        self.node = settings.node_name
        self.policy = settings.policy
        self.catalog = CatalogCache(store, self.clock)
        self.launcher = Launcher(settings, store, self.catalog, gpus,
                                 bindable or (lambda port: can_bind(settings.engine_host, port)))
        self.local: dict[str, Local] = {}
        self.members: dict[str, dict] = {}  # facts of multi-node member parts (never in Redis)
        self.orphan_terms: dict[str, float] = {}  # when SIGTERM went to an attempt without a record
        self.started_at = self.clock.time()
        self.targets: list[ScrapeTarget] = []
        self.starting = False  # an attempt is starting: pass again soon (`next_wait`)
        self.stopping = threading.Event()  # set when the agent shuts down (workers.agent.step)
        self._warned: dict[str, float] = {}
        self._probe_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmgw-probe")

    # --- one pass --------------------------------------------------------------------------------
    def tick(self) -> list[sv.Action]:
        """One pass of the loop. Returns the actions decided (for tests and logs)."""
        now = self.clock.time()
        records = self.store.replicas_on(self.node)
        ids = {r.id for r in records}
        for memory in (self.local, self.members):
            for rid in [k for k in memory if k not in ids]:
                del memory[rid]
        found = self.runner.discover()
        views, observed = self._observe(records, found, now)
        rest = self._leftovers(ids, found, now)
        actions = sv.decide(views, observed, list(rest.orphans), now, self.policy, self.node)
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
        member: dict[str, Any] = {} if head else dict(
            head_attempt=stored.attempt if stored.running else 0,
            joined_attempt=self.members.get(view.id, {}).get("joined_attempt"))
        loc = self.local.get(view.id)
        if loc is not None and loc.memory.attempt != view.attempt:  # the memory of an earlier attempt
            del self.local[view.id]
            loc = None
        if not view.running:
            return sv.Observed(known=loc is not None and loc.memory.known, **member)
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
        """`/health` of the running attempts whose probe is due, concurrently; results go to `observed`."""
        due = []
        for rec in views:
            obs, loc = observed[rec.id], self.local.get(rec.id)
            if not obs.alive or not obs.has_health or loc is None or rec.stop_requested_at is not None or not rec.url:
                continue
            # A starting attempt is probed often: the moment it answers is the moment it can be routed.
            every = self.settings.probe_interval if sv.ready_this_attempt(rec) else self.settings.start_probe_interval
            if loc.memory.last_probe_at is not None and now - loc.memory.last_probe_at < every:
                continue
            path = loc.launch.spec.health_path if loc.launch else "/health"
            due.append((rec.id, loc, rec.url.rstrip("/") + path))
        results = self._probe_pool.map(lambda item: self.prober.health(item[2], self.settings.probe_timeout), due)
        for (rid, loc, _url), res in zip(due, results):
            observed[rid] = dataclasses.replace(observed[rid], probe_ok=res.ok, probe_error=res.error,
                                                probe_failures=loc.memory.probe_failures)

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
        writes: dict[str, dict[str, Any]] = {}
        signals, starts = [], []
        for action in actions:
            try:
                if isinstance(action, sv.Signal):
                    signals.append(action)
                elif isinstance(action, sv.Start):
                    starts.append(action)
                else:
                    self._record(by_id[action.replica_id], action, writes)
                    self._remember(action, now)
            except Exception:  # noqa: BLE001 - one bad replica must not stop the others
                log.exception("replica %s: %s failed", action.replica_id, type(action).__name__)
        launches = self._prepare(starts, by_id, records, writes, now)
        existing = self.store.update_replicas(writes)
        # What the scraper reads: Ready heads, as this pass leaves them.
        now_views = [dataclasses.replace(v, **{k: x for k, x in writes.get(v.id, {}).items() if k in _RECORD_FIELDS})
                     for v in views if v.node == self.node]
        self.targets = scrape_targets(now_views, {rid: loc.launch for rid, loc in self.local.items()})
        for action in signals:
            self._signal(action, now)
        spawned: dict[str, dict[str, Any]] = {}
        for rec, start, launch in launches:
            if rec.node == self.node and rec.id not in existing:
                continue  # the record was deleted meanwhile
            self._spawn(rec, start, launch, now, spawned, writes.get(rec.id, {}))
        self.store.update_replicas(spawned)
        self._announce(actions, by_id)

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

    def _record(self, rec: ReplicaRecord, facts: sv.Facts, writes: dict[str, dict[str, Any]]) -> None:
        """Facts of this node's part go to the record for the head, to this agent's memory for a member
        part; confirmations go to the record either way."""
        fields = dict(facts.fields)
        if facts.tail is not None:
            tail = self.runner.log_tail(rec.id, sv.LOG_TAIL_BYTES) + facts.tail
            fields["log_tail"] = tail[-sv.LOG_TAIL_BYTES:]
        if rec.node == self.node:
            writes.setdefault(rec.id, {}).update(fields)
        else:
            self.members.setdefault(rec.id, {}).update(fields)
        if facts.confirm:
            writes.setdefault(rec.id, {}).update(facts.confirm)
        if facts.message:
            log.log(facts.level, "replica %s: %s", rec.id, facts.message)

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
                 writes: dict[str, dict[str, Any]], now: float) -> list[tuple[ReplicaRecord, sv.Start, Launch]]:
        """Each Start's port and command, its intent recorded in `writes`; a launch that cannot even be
        built is recorded as a failed attempt."""
        # Ports held by any record on this node, including this agent's member parts.
        reserved = ({r.port for r in records if r.port} | {v.port for v in by_id.values() if v.port}
                    | {r.master_port for r in records if r.master_port and r.node == self.node})
        out = []
        for start in starts:
            if self.stopping.is_set():
                break  # shutting down: stop_engines() may already have made its list
            rec = by_id[start.replica_id]
            try:
                launch = self.launcher.prepare(rec, reserved)
            except Exception as e:  # noqa: BLE001 - e.g. no free port, an engine binary missing
                self._record(rec, sv.launch_failed(rec, start.attempt, now, f"cannot build the launch: {e}",
                                                   self.policy), writes)
                continue
            if launch is None:
                self.warn(rec.id, f"model {rec.model!r} profile {rec.profile!r} is not in the applied catalog; "
                                   "not starting")
                continue
            reserved |= {p for p in (launch.port, launch.master_port) if p is not None}
            fields = sv.starting(rec, start, now, launch.port, launch.url, launch.master_port, launch.spec.serves_http,
                                 log_path=str(self.runner.log_path(rec.id)))
            self._record(rec, sv.Facts(fields=fields), writes)
            out.append((rec, start, launch))
        return out

    def _spawn(self, rec: ReplicaRecord, start: sv.Start, launch: Launch, now: float,
               writes: dict[str, dict[str, Any]], intent: dict[str, Any]) -> None:
        self.local[rec.id] = Local(sv.Attempt(attempt=start.attempt, known=True), launch)
        try:
            if rec.node == self.node:  # the record it starts with, kept beside it (supervisor.restored)
                started = dataclasses.replace(rec, **{k: v for k, v in intent.items() if k in _RECORD_FIELDS})
                self.runner.save_record(rec.id, started.to_dict())
            pid, pid_start = self.runner.spawn(rec.id, start.attempt, launch.spec)
        except Exception as e:  # noqa: BLE001
            self.local.pop(rec.id, None)
            self._record(rec, sv.launch_failed(rec, start.attempt, now, f"cannot start the shim: {e}", self.policy),
                         writes)
            return
        log.info("replica %s: %s attempt %d on port %d (pid %d): %s", rec.id,
                 "restarting," if start.restart else "starting,", start.attempt, launch.port, pid,
                 " ".join(launch.spec.argv))
        self._record(rec, sv.Facts(fields={"pid": pid, "pid_start": pid_start}), writes)

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

    def heartbeat(self) -> None:
        info = node_info(self.settings, self.gpus, self.started_at, self.clock.time())
        self.store.write_heartbeat(info, self.settings.heartbeat_ttl)

    def stop_engines(self) -> None:
        """Stop every running attempt on this node with the supervisor's one escalation (SIGTERM, then
        SIGKILL once the grace period is over) and record the exits (not as failures: the next agent
        starts them again at once)."""
        now = self.clock.time()
        found = self.runner.discover()
        try:
            records = [sv.part_view(r, self.members.get(r.id, {}), found.get(r.id), self.node, now)[0]
                       for r in self.store.replicas_on(self.node)]
        except Exception:  # noqa: BLE001 - Redis gone: fall back to the state dir
            log.exception("cannot read the replica records; stopping what the state dir lists")
            records = []
        running: dict[str, tuple[ReplicaRecord | None, int, int, int | None]] = {}
        for rec in records:
            if rec.running:
                seen = self.runner.observe(rec.id, rec.attempt, rec.pid, rec.pid_start)
                if seen.alive and seen.pid:
                    running[rec.id] = (rec, rec.attempt, seen.pid, seen.pid_start)
        for rid, f in found.items():
            if f.alive and rid not in running:
                running[rid] = (None, f.attempt, f.pid, f.pid_start)
        terms: dict[str, float] = {}
        exits: dict[str, sv.ExitFacts | None] = {}
        pending = dict(running)
        give_up = self.clock.monotonic() + self.policy.stop_grace + 5.0  # SIGKILL's own wait, bounded
        while pending:
            t = self.clock.monotonic()
            for rid, (_rec, attempt, pid, start) in list(pending.items()):
                for s in sv.stop_signals(rid, pid, start, terms.get(rid), t, self.policy, "the agent is stopping"):
                    if s.sig == signal.SIGKILL:
                        log.warning("replica %s: still running after %.0fs; SIGKILL", rid, self.policy.stop_grace)
                    self.runner.signal(rid, pid, start, s.sig)
                    terms.setdefault(rid, t)
                seen = self.runner.observe(rid, attempt, pid, start)
                if not seen.alive:
                    exits[rid] = seen.exit
                    del pending[rid]
            if pending and self.clock.monotonic() < give_up:
                self.sleep(0.1)
            elif pending:
                log.error("engines still running after SIGKILL: %s", ", ".join(sorted(pending)))
                break
        now = self.clock.time()
        writes: dict[str, dict[str, Any]] = {}
        for rid, (rec, attempt, pid, start) in running.items():
            if rec is not None and rec.node == self.node:
                exit = exits[rid] if rid in exits else self.runner.observe(rid, attempt, pid, start).exit
                self._record(rec, sv.shutdown_exit(rec, exit, now), writes)
        try:
            self.store.update_replicas(writes)
        except Exception:  # noqa: BLE001
            log.exception("cannot record the shutdown of %s", ", ".join(sorted(writes)))
        log.info("agent stopped %d engine(s)", len(running))
