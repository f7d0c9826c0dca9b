"""The node agent: a level-based loop that turns this node's replica records into serving processes.

Each pass (`Agent.tick`) reads the records on this node, observes their processes (the runner seam),
probes the running ones (the prober seam), asks `workers.agent.supervisor.decide` what to do, and
applies the actions, writing only AGENT_FIELDS facts. The loop never dies: a failing replica is logged
with its id and skipped. Threads beside the loop: the heartbeat and the `/metrics` scraper, so neither
a slow Redis write nor a hung engine can stall supervision.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis

from llmgw.catalog import Catalog, Model, Profile, read_applied
from llmgw.engines import get_engine
from llmgw.engines.base import LaunchContext, LaunchSpec
from llmgw.proc.ports import can_bind
from llmgw.state import keys
from llmgw.state.clock import Clock
from llmgw.state.records import GPUDevice, ReplicaRecord
from llmgw.state.store import Store
from workers.agent import supervisor as sv
from workers.agent.config import AgentSettings
from workers.agent.inventory import node_info
from workers.agent.ports import NoFreePort, choose_port

log = logging.getLogger("llmgw.agent")

LOG_TAIL_BYTES = 4000


@dataclass
class Local:
    """What this agent process remembers about one replica's current attempt (lost on restart;
    everything that must survive a restart is in Redis or the state dir)."""

    attempt: int = 0
    known: bool = False
    term_sent_at: float | None = None
    term_reason: str = ""
    last_ok_at: float | None = None
    last_probe_at: float | None = None
    probe_failures: int = 0  # consecutive failed probes
    spec: LaunchSpec | None = None
    engine: str = ""
    profile: Profile | None = None


@dataclass(frozen=True)
class ScrapeTarget:
    replica_id: str
    url: str
    engine: str
    profile: Profile | None


class CatalogCache:
    """The applied catalog, re-read at most every `ttl` seconds (a pass may need it many times)."""

    def __init__(self, r: redis.Redis, clock: Clock, ttl: float = 2.0):
        self.r, self.clock, self.ttl = r, clock, ttl
        self.version, self.catalog, self.fetched = 0, None, -1e18

    def get(self, fresh: bool = False) -> Catalog | None:
        now = self.clock.monotonic()
        if fresh or now - self.fetched >= self.ttl:
            self.version, self.catalog, _ = read_applied(self.r)
            self.fetched = now
        return self.catalog

    def lookup(self, rec: ReplicaRecord) -> tuple[Model, Profile] | None:
        cat = self.get()
        model = cat.model(rec.model) if cat else None
        profile = model.profile(rec.profile) if model else None
        return (model, profile) if model and profile else None


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        store: Store,
        runner: Any,
        prober: Any,
        clock: Clock | None = None,
        gpus: tuple[GPUDevice, ...] = (),
        bindable=None,
        sleep=None,
    ):
        self.settings, self.store = settings, store
        self.runner, self.prober = runner, prober
        self.clock = clock or Clock()
        # Waiting during shutdown goes through the clock too (a fake clock's `sleep` advances it).
        self.sleep = sleep or getattr(self.clock, "sleep", None) or time.sleep
        self.gpus = gpus
        self.node = settings.node_name
        self.policy = settings.policy
        self.bindable = bindable or (lambda port: can_bind(settings.engine_host, port))
        self.catalog = CatalogCache(store.r, self.clock)
        self.local: dict[str, Local] = {}
        self.members: dict[str, dict] = {}  # agent facts of multi-node member parts (never in Redis)
        self.orphan_terms: dict[str, float] = {}
        self.started_at = self.clock.time()
        self.targets: list[ScrapeTarget] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._warned: dict[str, float] = {}
        self._probe_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmgw-probe")

    # --- one pass --------------------------------------------------------------------------------
    def tick(self) -> list[sv.Action]:
        """One pass of the loop. Returns the actions applied (for tests and logs)."""
        now = self.clock.time()
        records = self.store.replicas_on(self.node)
        ids = {r.id for r in records}
        for memory in (self.local, self.members):
            for rid in [k for k in memory if k not in ids]:
                del memory[rid]
        views, observed = [], {}
        for rec in records:
            try:
                view = self._view(rec)
                observed[rec.id] = self._observe(view, now, rec)
                views.append(view)
            except Exception as e:  # noqa: BLE001 - skip it this pass, keep supervising the others
                self._warn(rec.id, f"cannot observe its process, skipped this pass: {e!r}")
        views = self._probe(views, observed, now)
        orphans = self._orphans(ids, now)
        actions = sv.decide(views, observed, orphans, now, self.policy)
        by_id = {v.id: v for v in views}
        # Ports held by any record on this node, including this agent's member parts.
        reserved = ({r.port for r in records if r.port} | {v.port for v in views if v.port}
                    | {r.master_port for r in records if r.master_port and self._is_head(r)})
        for action in actions:
            try:
                self._apply(action, by_id.get(action.replica_id), now, reserved)
            except Exception:  # noqa: BLE001 - one bad replica must not stop the others
                log.exception("replica %s: %s failed", action.replica_id, type(action).__name__)
        self._update_targets(views)
        return actions

    def _is_head(self, rec: ReplicaRecord) -> bool:
        return rec.node == self.node

    def _view(self, rec: ReplicaRecord) -> ReplicaRecord:
        """The record as the decision sees it: for a member part of a multi-node replica (this node is
        not its head) the agent fields are this agent's own memory, since only the head writes them."""
        if self._is_head(rec):
            return rec
        facts = self.members.setdefault(rec.id, {})
        if not facts:
            found = self.runner.discover().get(rec.id)
            if found and found.alive:
                # A part started by a previous agent: adopt it, assuming it joined the head's current
                # attempt (if the head has moved on since, the part cannot rejoin: it fails and restarts).
                facts.update(attempt=found.attempt, pid=found.pid, pid_start=found.pid_start,
                             started_at=self.clock.time(), first_ready_at=self.clock.time(),
                             joined_attempt=rec.attempt)
            elif self.node in rec.stopped_nodes:
                # This node already confirmed its part stopped (before this agent restarted).
                facts["stopped_at"] = rec.stop_requested_at or self.clock.time()
        blank = {f: getattr(ReplicaRecord(id="", model="", profile=""), f) for f in _AGENT_VIEW_FIELDS}
        return dataclasses.replace(rec, **{**blank, **{k: v for k, v in facts.items() if k in blank}})

    def _observe(self, rec: ReplicaRecord, now: float, stored: ReplicaRecord | None = None) -> sv.Observed:
        """`rec` is the view (see `_view`); `stored` the record as read, whose agent fields are the
        head's: a member part follows the head's attempt."""
        stored = stored or rec
        member: dict[str, Any] = {}
        if not self._is_head(rec):
            member = dict(head_attempt=stored.attempt if stored.running else 0,
                          joined_attempt=self.members.get(rec.id, {}).get("joined_attempt"))
        loc = self.local.get(rec.id)
        if loc is not None and loc.attempt != rec.attempt:
            loc = None
            self.local.pop(rec.id, None)
        if not rec.running:
            return sv.Observed(known=loc is not None and loc.known, **member)
        seen = self.runner.observe(rec.id, rec.attempt, rec.pid, rec.pid_start)
        if loc is None:
            loc = self.local[rec.id] = Local(attempt=rec.attempt)
        if loc.spec is None:
            self._fill_spec(rec, loc)
        if self._is_head(rec) and seen.engine_pid and seen.engine_pid != rec.engine_pid and seen.alive:
            self.store.update_replica(rec.id, engine_pid=seen.engine_pid)
        return sv.Observed(
            alive=seen.alive,
            exit=seen.exit,
            known=loc.known,
            pid=seen.pid,
            pid_start=seen.pid_start,
            engine_pid=seen.engine_pid,
            term_sent_at=loc.term_sent_at,
            term_reason=loc.term_reason,
            last_ok_at=loc.last_ok_at,
            start_timeout=loc.spec.start_timeout if loc.spec else 120.0,
            has_health=self._is_head(rec) and (loc.spec is None or loc.spec.serves_http),
            **member,
        )

    def _fill_spec(self, rec: ReplicaRecord, loc: Local) -> None:
        """The launch spec of an attempt this agent did not start (adopted), for its probe paths and
        start timeout. Without the catalog entry the defaults apply."""
        try:
            found = self.catalog.lookup(rec)
            if found and rec.port:
                loc.spec = self._command(rec, found[0], found[1], rec.port)
                loc.engine, loc.profile = found[1].engine, found[1]
        except Exception as e:  # noqa: BLE001
            self._warn(rec.id, f"cannot rebuild its launch spec: {e}")

    # --- probes ----------------------------------------------------------------------------------
    def _probe(self, views, observed, now) -> list[ReplicaRecord]:
        due = []
        for rec in views:
            obs, loc = observed[rec.id], self.local.get(rec.id)
            if not obs.alive or loc is None or rec.stop_requested_at is not None or not rec.url:
                continue
            if not self._is_head(rec) or (loc.spec is not None and not loc.spec.serves_http):
                continue
            if loc.last_probe_at is not None and now - loc.last_probe_at < self.settings.probe_interval:
                continue
            path = loc.spec.health_path if loc.spec else "/health"
            due.append((rec, loc, rec.url.rstrip("/") + path))
        if not due:
            return views
        results = list(self._probe_pool.map(
            lambda item: self.prober.health(item[2], self.settings.probe_timeout), due))
        updated = {}
        for (rec, loc, _url), res in zip(due, results):
            outcome = sv.probed(rec, loc.probe_failures, res.ok, res.error, now, self.policy)
            loc.last_probe_at, loc.probe_failures = now, outcome.probe_failures
            if outcome.ok:
                loc.last_ok_at = now
            if outcome.became_ready:
                log.info("replica %s: ready at %s (attempt %d)", rec.id, rec.url, rec.attempt)
            if outcome.fields:
                self.store.update_replica(rec.id, **outcome.fields)
                updated[rec.id] = dataclasses.replace(rec, **outcome.fields)
        return [updated.get(v.id, v) for v in views]

    # --- orphans ---------------------------------------------------------------------------------
    def _orphans(self, record_ids: set[str], now: float) -> list[sv.Orphan]:
        out = []
        found = self.runner.discover()
        for rid, f in found.items():
            if rid in record_ids:
                continue
            if f.alive:
                out.append(sv.Orphan(rid, f.pid, f.pid_start, self.orphan_terms.get(rid)))
            else:
                self.orphan_terms.pop(rid, None)
        if out and self.catalog.get(fresh=True) is None:
            # No catalog at all: this Redis was wiped or is the wrong one (a mistyped REDIS_URL). Don't
            # read that as "every replica was deleted" and stop every engine on the node.
            self._warn("*", f"no catalog in Redis: leaving {len(out)} engine(s) without a record alone")
            return []
        for rid in self.runner.known_dirs():
            if rid in record_ids or (rid in found and found[rid].alive):
                continue
            if now - self.runner.last_activity(rid) > self.settings.dir_retention:
                log.info("replica %s: removing the files of a deleted replica", rid)
                self.runner.remove(rid)
        return out

    # --- actions ---------------------------------------------------------------------------------
    def _apply(self, action, rec: ReplicaRecord | None, now: float, reserved: set[int]) -> None:
        if isinstance(action, sv.Signal):
            self._signal(action, now)
            return
        assert rec is not None
        head = self._is_head(rec)
        if isinstance(action, sv.Start):
            self._start(rec, action, now, reserved)
        elif isinstance(action, sv.Adopt):
            loc = self.local.setdefault(rec.id, Local(attempt=rec.attempt))
            loc.known, loc.last_ok_at = True, now
            log.info("replica %s: adopted running attempt %d (pid %s)", rec.id, rec.attempt, action.pid)
            if head:
                fields = {"adopted_at": now}
                if rec.pid is None:
                    fields.update(pid=action.pid, pid_start=action.pid_start)
                if action.engine_pid and rec.engine_pid is None:
                    fields["engine_pid"] = action.engine_pid
                self.store.update_replica(rec.id, **fields)
        elif isinstance(action, sv.RecordExit):
            self.local.pop(rec.id, None)
            tail = self.runner.log_tail(rec.id, LOG_TAIL_BYTES)
            if action.reason:
                tail = (tail + f"\n[llmgw-agent] terminated: {action.reason}\n")[-LOG_TAIL_BYTES:]
            log.warning(
                "replica %s: attempt %d ended unexpectedly (code %s, signal %s)%s; restart in %.1fs",
                rec.id, rec.attempt, action.exit.exit_code, action.exit.exit_signal,
                f" ({action.reason})" if action.reason else "", max(0.0, action.next_restart_at - now),
            )
            fields = dict(
                exit_code=action.exit.exit_code, exit_signal=action.exit.exit_signal,
                exited_at=max(action.exit.exited_at, rec.started_at or 0.0),
                failure_times=list(action.failure_times), next_restart_at=action.next_restart_at,
                restarts=action.restarts, log_tail=tail,
            )
            self._write(rec, head, fields)
        elif isinstance(action, sv.Rejoin):
            self.local.pop(rec.id, None)
            log.info("replica %s: part of head attempt %s ended; rejoining the head's attempt",
                     rec.id, self.members.get(rec.id, {}).get("joined_attempt"))
            self._write(rec, head, dict(exit_code=action.exit.exit_code, exit_signal=action.exit.exit_signal,
                                        exited_at=max(action.exit.exited_at, rec.started_at or 0.0),
                                        next_restart_at=None))
        elif isinstance(action, sv.LaunchFailed):
            log.error("replica %s: %s", rec.id, action.reason)
            self._write(rec, head, dict(
                attempt=action.attempt, started_at=action.at, exited_at=action.at, exit_code=None,
                exit_signal=None, failure_times=list(action.failure_times),
                next_restart_at=action.next_restart_at, restarts=action.restarts,
                log_tail=f"[llmgw-agent] {action.reason}",
            ))
        elif isinstance(action, sv.MarkStopped):
            self.local.pop(rec.id, None)
            fields: dict[str, Any] = {"stopped_at": action.stopped_at}
            if action.exit is not None:
                fields.update(exit_code=action.exit.exit_code, exit_signal=action.exit.exit_signal,
                              exited_at=max(action.exit.exited_at, rec.started_at or 0.0))
            elif rec.running:
                fields["exited_at"] = now
            if rec.started_at is not None:
                fields["log_tail"] = self.runner.log_tail(rec.id, LOG_TAIL_BYTES)
            log.info("replica %s: stopped", rec.id)
            self._write(rec, head, fields)
            if len(rec.all_nodes) > 1:
                # Each node confirms its own part (its own field: no race between the agents); the
                # replica is Stopped, and its GPUs free, once every node has.
                self.store.update_replica(rec.id, **{keys.replica_stopped_on(self.node): action.stopped_at})

    def _write(self, rec: ReplicaRecord, head: bool, fields: dict) -> bool:
        """Agent facts go to the record for the head; a member part keeps them in this agent's memory."""
        if head:
            return self.store.update_replica(rec.id, **fields)
        self.members.setdefault(rec.id, {}).update(fields)
        return True

    def _signal(self, action: sv.Signal, now: float) -> None:
        name = signal.Signals(action.sig).name
        log.info("replica %s: sending %s to pid %d: %s", action.replica_id, name, action.pid, action.reason)
        self.runner.signal(action.replica_id, action.pid, action.pid_start, action.sig)
        if action.sig == signal.SIGTERM:
            if action.orphan:
                self.orphan_terms[action.replica_id] = now
            else:
                loc = self.local.setdefault(action.replica_id, Local())
                loc.term_sent_at, loc.term_reason = now, action.reason

    def _command(self, rec: ReplicaRecord, model: Model, profile: Profile, port: int,
                 master_port: int | None = None) -> LaunchSpec:
        """The engine command for this node's part. `master_port`: the head's rendezvous port (the
        head passes the one it just chose; a member part uses the one the head recorded)."""
        nodes = rec.all_nodes
        rank = nodes.index(self.node) if self.node in nodes else 0
        master = None
        if len(nodes) > 1:
            if self._is_head(rec):
                master = self.settings.node_address
            else:
                head = self.store.live_nodes().get(nodes[0])
                master = head.address if head else None
        ctx = LaunchContext(
            replica_id=rec.id, model=model, profile=profile, host=self.settings.engine_host, port=port,
            gpus=tuple(rec.gpus.get(self.node, [])), node=self.node, node_rank=rank, nnodes=len(nodes),
            master_addr=master, master_port=master_port if master_port is not None else rec.master_port,
        )
        spec = get_engine(profile.engine).command(ctx)
        if self.gpus and "CUDA_VISIBLE_DEVICES" not in spec.env:
            # On a GPU node, an engine sees only the GPUs placement gave it (none for a CPU replica), so
            # a CUDA build of llama.cpp cannot wander onto another replica's card.
            spec = dataclasses.replace(spec, env={**spec.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, ctx.gpus))})
        return spec

    def _start(self, rec: ReplicaRecord, action: sv.Start, now: float, reserved: set[int]) -> None:
        if self._stop.is_set():
            return  # shutting down: stop_engines() may already have made its list
        head = self._is_head(rec)
        found = self.catalog.lookup(rec)
        if found is None:
            self._warn(rec.id, f"model {rec.model!r} profile {rec.profile!r} is not in the applied catalog; not starting")
            return
        model, profile = found
        multi_head = head and len(rec.all_nodes) > 1
        master_port = None
        try:
            port = choose_port(self.settings.port_range, reserved - {rec.port}, self.bindable, prefer=rec.port)
            if multi_head:
                # The rendezvous port the members join, from this node's range like the HTTP port.
                master_port = choose_port(self.settings.port_range, (reserved - {rec.master_port}) | {port},
                                          self.bindable, prefer=rec.master_port)
            spec = self._command(rec, model, profile, port, master_port)
        except (NoFreePort, Exception) as e:  # noqa: BLE001 - a launch that cannot even be built is a failed attempt
            self._launch_failed(rec, action, now, head, f"cannot build the launch: {e}")
            return
        reserved.add(port)
        if master_port is not None:
            reserved.add(master_port)
        url = f"http://{self.settings.node_address}:{port}"
        # Bookkeeping before the side effect: a crash after this line leaves a record that the next
        # pass reads as a failed attempt (and restarts), never an untracked process.
        fields = dict(
            attempt=action.attempt, started_at=now, port=port, url=url if head else rec.url,
            pid=None, pid_start=None, engine_pid=None, exit_code=None, exit_signal=None,
            next_restart_at=None, last_probe_ok=None, probe_error=None, adopted_at=None,
        )
        if multi_head:
            fields["master_port"] = master_port  # written with `attempt`: members join this attempt
        if not spec.serves_http:
            fields["first_ready_at"] = now  # a headless part is "ready" while it runs
        if not head:
            fields["joined_attempt"] = action.head_attempt
        if not self._write(rec, head, fields):
            return  # the record was deleted meanwhile
        self.local[rec.id] = Local(attempt=action.attempt, known=True, spec=spec, engine=profile.engine,
                                   profile=profile)
        try:
            pid, pid_start = self.runner.spawn(rec.id, action.attempt, spec)
        except Exception as e:  # noqa: BLE001
            self.local.pop(rec.id, None)
            self._launch_failed(rec, action, now, head, f"cannot start the shim: {e}")
            return
        log.info("replica %s: %s attempt %d on port %d (pid %d): %s", rec.id,
                 "restarting, " if action.restart else "starting,", action.attempt, port, pid,
                 " ".join(spec.argv))
        self._write(rec, head, {"pid": pid, "pid_start": pid_start})

    def _launch_failed(self, rec, action, now, head, reason: str) -> None:
        self._apply(sv.launch_failed(rec, action.attempt, now, reason, self.policy), rec, now, set())

    def _warn(self, key: str, text: str, interval: float = 60.0) -> None:
        """Log a repeated condition at most once a minute."""
        now = self.clock.monotonic()
        if now - self._warned.get(key + text, -1e18) >= interval:
            if len(self._warned) > 1000:
                self._warned.clear()
            self._warned[key + text] = now
            log.warning("%s", text if key == "*" else f"replica {key}: {text}")

    def _update_targets(self, views: list[ReplicaRecord]) -> None:
        targets = []
        for rec in views:
            loc = self.local.get(rec.id)
            if not self._is_head(rec) or loc is None or rec.stop_requested_at is not None or not rec.url:
                continue
            if rec.running and sv.ready_this_attempt(rec) and rec.last_probe_ok:
                path = loc.spec.metrics_path if loc.spec else "/metrics"
                targets.append(ScrapeTarget(rec.id, rec.url.rstrip("/") + path, loc.engine, loc.profile))
        self.targets = targets

    # --- heartbeat -------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        info = node_info(self.settings, self.gpus, self.started_at, self.clock.time())
        self.store.write_heartbeat(info, self.settings.heartbeat_ttl)

    # --- threads ---------------------------------------------------------------------------------
    def start(self) -> None:
        from workers.agent.scrape import Scraper

        scraper = Scraper(self.store, self.prober, lambda: self.targets, self.settings, self.clock)
        for name, target in (("llmgw-agent-loop", self._run_loop), ("llmgw-agent-heartbeat", self._run_heartbeat),
                             ("llmgw-agent-scrape", lambda: scraper.run(self._stop))):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("node agent for %s started (port range %s, state dir %s)", self.node,
                 self.settings.port_range, self.settings.state_dir)

    def _run_heartbeat(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.heartbeat()
                failing = False
            except Exception as e:  # noqa: BLE001
                if not failing:
                    log.exception("heartbeat failed")
                else:
                    self._warn("*", f"heartbeats still failing: {e}", interval=30)
                failing = True
            self._stop.wait(self.settings.heartbeat_interval)

    def _run_loop(self) -> None:
        wake = keys.agent_wake(self.node)
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                self.tick()
                if failing_since is not None:
                    log.info("agent passes succeed again after %.1fs", self.clock.monotonic() - failing_since)
                    failing_since = None
            except Exception as e:  # noqa: BLE001 - e.g. Redis down: log, wait, try again
                # Engines keep running while Redis is away; say so once, then every 30 s, not every tick.
                if failing_since is None:
                    failing_since = self.clock.monotonic()
                    log.exception("agent pass failed; engines are left as they are until it succeeds")
                else:
                    self._warn("*", f"agent passes still failing: {e}", interval=30)
                self._stop.wait(self.settings.tick)
                continue
            try:
                if self.store.r.blpop([wake], timeout=self.settings.tick):
                    self.store.r.delete(wake)  # one pass handles every pending wake-up
            except Exception:  # noqa: BLE001
                self._stop.wait(self.settings.tick)

    def stop(self, keep_engines: bool | None = None) -> None:
        """Stop the threads; unless keeping them, stop this node's engines (SIGTERM, then SIGKILL)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if not self._threads:
            return  # never started: the engines on this node are not ours to stop
        for t in self._threads:
            t.join(self.settings.tick + self.settings.heartbeat_interval + 2)
        self._probe_pool.shutdown(wait=False)
        keep = self.settings.keep_engines if keep_engines is None else keep_engines
        if keep:
            log.info("agent stopping; engines keep running (LLMGW_AGENT_KEEP_ENGINES)")
            return
        self.stop_engines()

    def stop_engines(self) -> None:
        """SIGTERM every running attempt on this node, SIGKILL what is left after the grace period, and
        record the exits (not as failures: the next agent starts them again at once)."""
        try:
            records = [self._view(r) for r in self.store.replicas_on(self.node)]
        except Exception:  # noqa: BLE001 - Redis gone: fall back to the state dir
            log.exception("cannot read the replica records; stopping what the state dir lists")
            records = []
        running: dict[str, tuple[ReplicaRecord | None, int, int, int | None]] = {}
        for rec in records:
            if rec.running:
                seen = self.runner.observe(rec.id, rec.attempt, rec.pid, rec.pid_start)
                if seen.alive and seen.pid:
                    running[rec.id] = (rec, rec.attempt, seen.pid, seen.pid_start)
        for rid, f in self.runner.discover().items():
            if f.alive and rid not in running:
                running[rid] = (None, f.attempt, f.pid, f.pid_start)
        for rid, (_rec, _a, pid, start) in running.items():
            self.runner.signal(rid, pid, start, signal.SIGTERM)
        deadline = self.clock.monotonic() + self.policy.stop_grace
        pending = dict(running)
        while pending and self.clock.monotonic() < deadline:
            for rid, (rec, attempt, pid, start) in list(pending.items()):
                if not self.runner.observe(rid, attempt, pid, start).alive:
                    del pending[rid]
            if pending:
                self.sleep(0.1)
        for rid, (rec, attempt, pid, start) in pending.items():
            log.warning("replica %s: still running after %.0fs; SIGKILL", rid, self.policy.stop_grace)
            self.runner.signal(rid, pid, start, signal.SIGKILL)
        now = self.clock.time()
        for rid, (rec, attempt, pid, start) in running.items():
            seen = self.runner.observe(rid, attempt, pid, start)
            if rec is not None and self._is_head(rec):
                exit = seen.exit
                try:
                    self.store.update_replica(
                        rid, exited_at=max(exit.exited_at if exit else now, rec.started_at or 0.0),
                        exit_code=exit.exit_code if exit else None,
                        exit_signal=exit.exit_signal if exit else None,
                        next_restart_at=None, log_tail=self.runner.log_tail(rid, LOG_TAIL_BYTES),
                    )
                except Exception:  # noqa: BLE001
                    log.exception("replica %s: cannot record the shutdown", rid)
        log.info("agent stopped %d engine(s)", len(running))


# The agent fields a member part's view takes from the member agent's memory. `master_port` is not one
# of them: a member part uses the head's. (`joined_attempt`, the head attempt a part joined, lives in
# the same memory but is no record field.)
_AGENT_VIEW_FIELDS = (
    "port", "pid", "pid_start", "engine_pid", "started_at", "attempt", "exit_code", "exit_signal",
    "exited_at", "last_probe_at", "last_probe_ok", "probe_error", "first_ready_at", "restarts",
    "failure_times", "next_restart_at", "log_tail", "stopped_at", "adopted_at",
)
