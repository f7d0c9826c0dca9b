"""Builders and an in-memory fleet for the control plane's unit tests (no Redis, a fake clock).

`Sim` applies planned actions to records the way `workers.control.apply` does, and plays the node
agents (`sim.agents()` starts what was launched and marks it Ready, confirms stops), so a test can
run several reconcile passes and look at what the fleet went through. `PassSim` runs the whole pass
(`workers.control.reconcile.decide`: autoscaling, plan, LoRA adapters) and keeps what the store
keeps between passes (the autoscaler's records and samples, the adapter rows) and the demand the
gateways and engines report.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from llmgw.catalog import Catalog, parse_catalog
from llmgw.gpus import parse_gpu_spec
from llmgw.state.demand_records import DemandHint, GatewayReport, ScaleState
from llmgw.state.node_records import NodeAdmin, NodeInfo
from llmgw.state.records import LoadRecord, ReplicaRecord
from llmgw.state.replica_state import State, derive, nodes_alive
from llmgw.state.views import AdapterRows, DemandView
from workers.control.autoscale import HISTORY_MAX
from workers.control.plan import (
    CreateReplica,
    DeleteRecord,
    DispatchLaunch,
    DispatchStop,
    PlaceReplica,
    StopReplica,
    UpdatePending,
    plan,
)
from workers.control.reconcile import PassEvent, Reconcile, decide, demand_reads
from workers.control.snapshot import Snapshot


def node(name: str, gpus: str = "", pool: str = "default", labels: dict | None = None) -> NodeInfo:
    return NodeInfo(name=name, gpus=parse_gpu_spec(gpus), pool=pool, labels=dict(labels or {}))


def catalog(*models: dict) -> Catalog:
    return parse_catalog({"models": list(models)})


def model(name: str, *profiles: dict, aliases=()) -> dict:
    return {"name": name, "aliases": list(aliases), "profiles": list(profiles)}


def gpu_profile(name="gpu", cls="h100", count=1, replicas=1, **kw) -> dict:
    nodes = kw.get("nodes", 1)
    return {"name": name, "engine": "vllm", "replicas": replicas, "gpu": {"class": cls, "count": count},
            "tensor_parallel": count * nodes, **kw}


def cpu_profile(name="cpu", replicas=1, **kw) -> dict:
    return {"name": name, "engine": "sim", "replicas": replicas, **kw}


def ready_record(rid, model_name, profile, node_name, now, spec_hash="", gpus=None, **kw) -> ReplicaRecord:
    return ReplicaRecord(
        id=rid, model=model_name, profile=profile, spec_hash=spec_hash, node=node_name,
        nodes=[node_name], gpus=gpus or {}, created_at=now - 100, started_at=now - 90,
        first_ready_at=now - 80, last_probe_ok=True, last_probe_at=now - 1, url=f"http://{node_name}:1/", **kw,
    )


@dataclass
class Sim:
    cat: Catalog
    nodes: dict[str, NodeInfo]
    now: float = 1000.0
    records: dict[str, ReplicaRecord] = field(default_factory=dict)
    admin: dict[str, NodeAdmin] = field(default_factory=dict)
    dispatched: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, id, node)
    history: list[list] = field(default_factory=list)
    last_seen: dict[str, float] = field(default_factory=dict)  # node -> last heartbeat
    credentials: dict[str, int] = field(default_factory=dict)  # model or "*" -> rotations
    wanted: dict[tuple[str, str], int] = field(default_factory=dict)  # the autoscaler's counts
    replica_load: dict[str, float] = field(default_factory=dict)
    weights: dict = field(default_factory=dict)  # remote source -> WeightsFacts

    def snapshot(self) -> Snapshot:
        return Snapshot(nodes=dict(self.nodes), replicas=tuple(self.records.values()), admin=dict(self.admin),
                        known=frozenset(self.nodes) | frozenset(self.last_seen), taken_at=self.now,
                        last_seen={**self.last_seen, **{n: self.now for n in self.nodes}},
                        credentials=dict(self.credentials), wanted=dict(self.wanted),
                        replica_load=dict(self.replica_load), weights=dict(self.weights))

    def lose(self, name: str) -> NodeInfo:
        """The node stops heartbeating now (its last heartbeat is remembered)."""
        self.last_seen[name] = self.now
        return self.nodes.pop(name)

    def alive(self, rec: ReplicaRecord) -> bool:
        return nodes_alive(rec, self.nodes)

    def state(self, rid: str) -> State:
        rec = self.records[rid]
        return derive(rec, self.alive(rec), self.now).state

    def states(self, model_name: str | None = None) -> dict[str, State]:
        return {i: self.state(i) for i, r in self.records.items() if model_name in (None, r.model)}

    def ready(self, model_name: str | None = None) -> list[str]:
        return sorted(i for i, s in self.states(model_name).items() if s is State.READY)

    def update(self, rid: str, **kw) -> None:
        if rid in self.records:
            self.records[rid] = dataclasses.replace(self.records[rid], **kw)

    def reconcile(self, **kw) -> list:
        actions = plan(self.cat, self.snapshot(), self.now, **kw)
        self.history.append(actions)
        for a in actions:
            self.apply(a)
        return actions

    def apply(self, a) -> None:
        now = self.now
        if isinstance(a, CreateReplica):
            assert a.id not in self.records, f"id reused: {a.id}"
            self.records[a.id] = a.record(now, engine_secret=f"secret-of-{a.id}")
            for n in a.placement.nodes if a.placement else ():
                self.dispatched.append(("launch", a.id, n))
        elif isinstance(a, PlaceReplica):
            self.update(a.id, **a.fields(now))
        elif isinstance(a, UpdatePending):
            self.update(a.id, **a.fields())
        elif isinstance(a, StopReplica):
            self.update(a.id, stop_requested_at=now, stop_reason=a.reason)
        elif isinstance(a, DeleteRecord):
            self.records.pop(a.id, None)
        elif isinstance(a, (DispatchLaunch, DispatchStop)):
            pass
        else:
            raise AssertionError(a)

    def agents(self, start: bool = True, ready: bool = True) -> None:
        """What the node agents would do by now: start launched replicas (and make them Ready),
        confirm stops."""
        for rid, rec in list(self.records.items()):
            if rec.node is None or not self.alive(rec):
                continue
            if rec.stop_requested_at is not None:
                if rec.stopped_at is None:
                    self.update(rid, stopped_at=self.now, exited_at=self.now)
                continue
            if start and not rec.running:
                self.update(rid, started_at=self.now, port=1, url=f"http://{rec.node}:1")
            if ready and self.records[rid].running and self.records[rid].first_ready_at is None:
                self.update(rid, first_ready_at=self.now, last_probe_ok=True, last_probe_at=self.now)

    def tick(self, seconds: float = 2.0) -> None:
        self.now += seconds

    def converge(self, passes: int = 10, **kw) -> None:
        for _ in range(passes):
            self.reconcile(**kw)
            self.agents()
            self.tick()

    def gpu_owners(self) -> dict[tuple[str, int], list[str]]:
        """(node, gpu index) -> ids of not-Stopped replicas holding it."""
        out: dict[tuple[str, int], list[str]] = {}
        for rid, rec in self.records.items():
            if self.state(rid) is State.STOPPED:
                continue
            for n, idxs in rec.gpus.items():
                for i in idxs:
                    out.setdefault((n, i), []).append(rid)
        return out


@dataclass
class PassSim(Sim):
    """`Sim` running the whole reconcile pass, with the facts it reads besides the fleet."""

    scale_states: dict[tuple[str, str], ScaleState] = field(default_factory=dict)
    samples: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)  # a sorted set: row -> t
    adapter_rows: AdapterRows = AdapterRows(None, [])
    gateways: list[GatewayReport] = field(default_factory=list)
    loads: dict[str, LoadRecord] = field(default_factory=dict)
    hints: dict[str, DemandHint] = field(default_factory=dict)
    events: list[PassEvent] = field(default_factory=list)

    def pass_snapshot(self) -> Snapshot:
        """What `load_snapshot(store, now, demand_reads(catalog, now))` would read."""
        reads = demand_reads(self.cat, self.now)
        histories = {key: tuple(json.loads(row) for row, _t in sorted(self.samples.get(key, {}).items(),
                                                                        key=lambda kv: (kv[1], kv[0]))
                                if _t >= since)
                     for key, since in reads.histories.items()}
        demand = DemandView(
            gateways=tuple(self.gateways) if reads.gateways else (),
            loads={r.id: self.loads[r.id] for r in self.records.values()
                   if (r.model, r.profile) in reads.loads and r.id in self.loads},
            hints={n: self.hints[n] for n in reads.hints if n in self.hints},
            scale_states=dict(self.scale_states), histories=histories, adapter_rows=self.adapter_rows)
        return dataclasses.replace(self.snapshot(), wanted={}, replica_load={}, demand=demand)

    def decide(self) -> Reconcile:
        return decide(self.cat, self.pass_snapshot(), self.now)

    def reconcile_pass(self) -> Reconcile:
        d = self.decide()
        self.history.append(list(d.actions))
        self.apply_pass(d)
        return d

    def apply_pass(self, d: Reconcile) -> None:
        """What `apply.apply_reconcile` writes, in its order."""
        s = d.scaling
        for p in s.scale.profiles:
            key = (p.model, p.profile)
            self.scale_states[key] = p.state
            rows = self.samples.setdefault(key, {})
            rows[json.dumps(p.sample.to_list(), separators=(",", ":"))] = p.sample.t
            since = s.keep_since.get(key, float("-inf"))
            kept = sorted(((t, row) for row, t in rows.items() if t >= since))[-HISTORY_MAX:]
            self.samples[key] = {row: t for t, row in kept}
        for key in s.forget:
            self.scale_states.pop(key, None)
            self.samples.pop(key, None)
        self.events.extend(s.events)
        for a in d.actions:
            self.apply(a)
        a = d.adapters
        if a.decision is not None:
            for rid, adapters in a.decision.wanted.items():
                self.update(rid, adapters_wanted=list(adapters))
            for rid, adapters in a.decision.relaunch.items():
                self.update(rid, adapters_relaunch=list(adapters))
        self.events.extend(a.events)
        if a.rows is not None:
            rows = [r.to_dict() for r in a.rows]
            self.adapter_rows = AdapterRows(self.now, rows) if rows else AdapterRows(None, [])

    def apply(self, a) -> None:
        if isinstance(a, DispatchLaunch):  # as `apply._apply_one`: the re-dispatch is recorded too
            self.update(a.id, launch_dispatched_at=self.now)
        else:
            super().apply(a)

    def agents(self, start: bool = True, ready: bool = True) -> None:
        """`Sim.agents`, and each engine holds the LoRA adapters its record wants (at launch for
        llama.cpp, loaded at once elsewhere)."""
        for rid, rec in list(self.records.items()):
            if start and rec.node is not None and self.alive(rec) and rec.stop_requested_at is None \
                    and not rec.running:
                self.update(rid, attempt=rec.attempt + 1)
        super().agents(start, ready)
        for rid, rec in list(self.records.items()):
            if rec.running and rec.stop_requested_at is None and rec.holds != rec.adapters_wanted:
                self.update(rid, adapters_held=list(rec.adapters_wanted), adapters_attempt=rec.attempt)
