"""What one node agent pass reads: the records on this node (one read), the attempts in the state dir
(one look), each running attempt's process (the runner seam), the `/health` probes
`supervisor.due_probes` says are due, how far each planned stop's drain has come, and what is left
without a record. The pass then decides over it (`supervisor.decide`) and acts (`act.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import drain_progress, head_drained
from llmgw.state.store import Store
from workers.agent import supervisor as sv
from workers.agent.launch import CatalogCache, Launcher
from workers.agent.memory import Local, Memory
from workers.agent.probe import HealthProbes
from workers.agent.weights import NodeWeights


class Observation(NamedTuple):
    """One pass's view of this node."""

    records: list[ReplicaRecord]  # the records on this node, as read
    views: list[ReplicaRecord]  # each part's view of its record (`supervisor.part_view`)
    observed: dict[str, sv.Observed]  # replica id -> what is known of its current attempt
    rest: sv.Leftovers  # attempts and files without a record, records to register again


class Observer:
    def __init__(self, node: str, store: Store, runner: Any, launcher: Launcher, catalog: CatalogCache,
                 weights: NodeWeights, probes: HealthProbes, memory: Memory, policy: sv.Policy,
                 dir_retention: float, warn: Callable[..., None]):
        self.node, self.store, self.runner, self.launcher, self.catalog = node, store, runner, launcher, catalog
        self.weights, self.probes, self.memory, self.policy = weights, probes, memory, policy
        self.dir_retention, self.warn = dir_retention, warn

    def observe(self, now: float) -> Observation:
        """Read this node once; the memory of replicas whose record is gone is dropped."""
        records = self.store.replicas_on(self.node)
        ids = {r.id for r in records}
        self.memory.forget_except(ids)
        self.weights.forget_except(ids)
        found = self.runner.discover()
        views, observed = self._observe(records, found, now)
        return Observation(records, views, observed, self._leftovers(ids, found, now))

    def part_views(self, found: dict[str, sv.Found], now: float) -> list[ReplicaRecord]:
        """Each record on this node as this node's part sees it, given the attempts `found` in the state
        dir (for stopping the engines: raises when Redis cannot be read)."""
        members = self.memory.members
        return [sv.part_view(r, members.get(r.id, {}), found.get(r.id), self.node, now)[0]
                for r in self.store.replicas_on(self.node)]

    def _observe(self, records: list[ReplicaRecord], found: dict, now: float):
        views, observed = [], {}
        for rec in records:
            try:
                view, facts = sv.part_view(rec, self.memory.members.get(rec.id, {}), found.get(rec.id), self.node,
                                           now)
                if facts:
                    self.memory.members[rec.id] = facts
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
        member = sv.head_of_part(stored, self.node, self.memory.members.get(view.id, {}))
        local = self.memory.local
        loc = local.get(view.id)
        if loc is not None and loc.memory.attempt != view.attempt:  # the memory of an earlier attempt
            del local[view.id]
            loc = None
        if not view.running:
            return sv.Observed(known=loc is not None and loc.memory.known, **member,
                               **self.weights.observe(view, lambda: self.catalog.lookup(view)))
        seen = self.runner.observe(view.id, view.attempt, view.pid, view.pid_start)
        if loc is None:
            loc = local[view.id] = Local(sv.Attempt(attempt=view.attempt))
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
        due = sv.due_probes(views, observed, self.memory.attempts(), self.memory.health_paths(), now, self.policy)
        for probe, res in zip(due, self.probes.run([p.url for p in due])):
            observed[probe.replica_id] = dataclasses.replace(
                observed[probe.replica_id], probe_ok=res.ok, probe_error=res.error, probe_failures=probe.failures)

    def _leftovers(self, ids: set[str], found: dict, now: float) -> sv.Leftovers:
        m = self.memory
        m.orphan_terms = {rid: t for rid, t in m.orphan_terms.items() if rid in found and found[rid].alive}
        dirs = {rid: self.runner.last_activity(rid) for rid in self.runner.known_dirs() if rid not in ids}
        applied = self.store.catalog_applied()
        saved = {} if applied else self._saved([rid for rid, f in found.items() if f.alive and rid not in ids])
        rest = sv.leftovers(found, ids, m.orphan_terms, applied, dirs, now, self.dir_retention, saved, self.node)
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
