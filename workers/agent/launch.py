"""Turning a replica record into the process to spawn for this node's part of it: the catalog entry,
a port from LLMGW_PORT_RANGE (and a multi-node head's rendezvous port), and the engine driver's
command with this node's GPUs. Reads the catalog (cached) and checks ports on the machine; decides
nothing about *whether* to start (that is `supervisor.decide`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from llmgw.catalog import Catalog, Model, Profile, read_applied
from llmgw.engines import get_engine
from llmgw.engines.base import LaunchContext, LaunchSpec
from llmgw.state.clock import Clock
from llmgw.state.node_records import GPUDevice
from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store
from llmgw.tracing import NO_SPAN
from workers.agent.config import AgentSettings
from workers.agent.cores import choose_cores, launch_cores
from workers.agent.ports import choose_port


@dataclass(frozen=True)
class Launch:
    """One attempt's process as this agent knows it: what it runs and where it listens."""

    spec: LaunchSpec
    engine: str
    profile: Profile
    port: int | None = None
    url: str = ""
    master_port: int | None = None  # a multi-node head's rendezvous port, chosen with `port`
    kv_ports: tuple[int, int] | None = None  # `kv_events: true`: its KV events and replay ports
    cpus: tuple[int, ...] = ()  # a CPU replica of vLLM: the cores its threads are bound to

    @property
    def ports(self) -> set[int]:
        """Every port this attempt holds on the node."""
        return {p for p in (self.port, self.master_port, *(self.kv_ports or ())) if p is not None}


class CatalogCache:
    """The applied catalog, re-read at most every `ttl` seconds (a pass may need it many times), and at
    once when a record names a model, profile or LoRA adapter the cached copy lacks: a replica the
    control plane placed (or gave an adapter) right after a catalog apply must not wait for the cache
    to expire before it starts (or loads it)."""

    def __init__(self, store: Store, clock: Clock, ttl: float = 2.0):
        self.store, self.clock, self.ttl = store, clock, ttl
        self.version, self.catalog, self.fetched = 0, None, -1e18

    def get(self, fresh: bool = False) -> Catalog | None:
        now = self.clock.monotonic()
        if fresh or now - self.fetched >= self.ttl:
            self.version, self.catalog, _ = read_applied(self.store)
            self.fetched = now
        return self.catalog

    def lookup(self, rec: ReplicaRecord) -> tuple[Model, Profile] | None:
        found = self.find(self.get(), rec)
        if (found is None or not _declares(found[0], rec.adapters_wanted)) and self.clock.monotonic() - self.fetched > 0.05:
            # Newer than our copy (a model, profile or adapter just applied), or really gone.
            found = self.find(self.get(fresh=True), rec)
        return found

    @staticmethod
    def find(cat: Catalog | None, rec: ReplicaRecord) -> tuple[Model, Profile] | None:
        model = cat.model(rec.model) if cat else None
        profile = model.profile(rec.profile) if model else None
        return (model, profile) if model and profile else None


def _declares(model: Model, adapters) -> bool:
    return all(model.adapter(name) is not None for name in adapters)


class Launcher:
    def __init__(self, settings: AgentSettings, store: Store, catalog: CatalogCache, gpus: tuple[GPUDevice, ...],
                 bindable: Callable[[int], bool], cores: tuple[int, ...] = (), memory_mb: int = 0):
        self.settings, self.store, self.catalog = settings, store, catalog
        self.gpus, self.bindable = gpus, bindable
        self.cores = cores  # the CPU cores this agent (and so its engines) may run on
        self.memory_mb = memory_mb  # this node's memory (0: unknown), which engines size host caches from
        self.node = settings.node_name

    def neighbours(self, rec: ReplicaRecord, records: list[ReplicaRecord]) -> tuple[Profile, ...]:
        """The profiles of the other replicas placed on this node that stay (not stopped, no stop asked
        for), as the cached catalog has them: what shares the node's memory with `rec`'s engine."""
        cat = self.catalog.get()
        found = [self.catalog.find(cat, r) for r in records
                 if r.id != rec.id and r.node == self.node and r.stopped_at is None and r.stop_requested_at is None]
        return tuple(f[1] for f in found if f is not None)

    def prepare(self, rec: ReplicaRecord, reserved: set[int], weights_path: str | None = None,
                held_cpus: list[tuple[int, ...]] | None = None,
                leaving_cpus: list[tuple[int, ...]] | None = None,
                neighbours: tuple[Profile, ...] = ()) -> Launch | None:
        """The next attempt of this node's part: ports chosen (never one in `reserved`, held by other
        records on this node), a CPU replica's cores (the least held in `held_cpus`, the cores of the
        other records on this node that stay, then in `leaving_cpus`, those of records being stopped;
        its processes restricted to `launch_cores`) and its command built (on `weights_path`, the
        downloaded weights, when the source is remote), beside `neighbours` (`neighbours`). None when the replica's
        model or profile is not in the applied catalog; raises (NoFreePorts, EngineUnavailable, ...) when it cannot
        be built."""
        found = self.catalog.lookup(rec)
        if found is None:
            return None
        model, profile = found
        port = choose_port(self.settings.port_range, reserved - {rec.port}, self.bindable, prefer=rec.port)
        master_port = None
        if rec.node == self.node and len(rec.all_nodes) > 1:
            # The rendezvous port the members join, from this node's range like the HTTP port.
            master_port = choose_port(self.settings.port_range, (reserved - {rec.master_port}) | {port},
                                      self.bindable, prefer=rec.master_port)
        kv_ports = None
        if profile.kv_events and rec.node == self.node:
            # The KV events (PUB) and replay (ROUTER) sockets, from the range like the HTTP port:
            # two replicas on one machine never both take vLLM's default 5557.
            held = {port} | ({master_port} if master_port else set())
            pub = choose_port(self.settings.port_range, (reserved - {rec.kv_events_port}) | held, self.bindable,
                              prefer=rec.kv_events_port)
            replay = choose_port(self.settings.port_range, (reserved - {rec.kv_replay_port}) | held | {pub},
                                 self.bindable, prefer=rec.kv_replay_port)
            kv_ports = (pub, replay)
        cpus: tuple[int, ...] = ()
        if profile.device == "cpu" and profile.gpu is None and get_engine(profile.engine).runs_on_cpu:
            cpus = choose_cores(self.cores, profile.cpu_threads, held_cpus or (), prefer=rec.cpus,
                                leaving=leaving_cpus or ())
        spec = self.command(rec, model, profile, port, master_port, weights_path, kv_ports, cpus, neighbours)
        if cpus:
            spec = dataclasses.replace(spec, cpus=launch_cores(self.cores, cpus, held_cpus or (),
                                                               leaving_cpus or ()))
        return Launch(spec, profile.engine, profile, port, f"http://{self.settings.node_address}:{port}", master_port,
                      kv_ports, cpus)

    def rebuild(self, rec: ReplicaRecord) -> Launch | None:
        """The launch of an attempt this agent did not start (adopted), for its probe paths and start
        timeout; None without the catalog entry (the defaults apply then)."""
        found = self.catalog.lookup(rec)
        if found is None or not rec.port:
            return None
        model, profile = found
        path = rec.weights_path if rec.weights_local_at is not None else None
        return Launch(self.command(rec, model, profile, rec.port, weights_path=path), profile.engine, profile,
                      rec.port, rec.url or "")

    def command(self, rec: ReplicaRecord, model: Model, profile: Profile, port: int,
                master_port: int | None = None, weights_path: str | None = None,
                kv_ports: tuple[int, int] | None = None, cpus: tuple[int, ...] | None = None,
                neighbours: tuple[Profile, ...] = ()) -> LaunchSpec:
        """The engine command for this node's part. `master_port`: the head's rendezvous port (the head
        passes the one it just chose; a member part uses the one the head recorded). `weights_path`:
        the engine loads the downloaded weights there, offline (HF_HUB_OFFLINE: vLLM never downloads
        by itself). `kv_ports`: the KV events ports just chosen (else the recorded ones); `cpus`: the
        cores just chosen (else the recorded ones); `neighbours`: the profiles of the other replicas on this
        node, which with the node's memory size an engine's host caches (llama.cpp's prompt cache)."""
        if weights_path:
            profile = profile.model_copy(update={"source": weights_path})
        nodes = rec.all_nodes
        rank = nodes.index(self.node) if self.node in nodes else 0
        master = None
        if len(nodes) > 1:
            if rec.node == self.node:
                master = self.settings.node_address
            else:
                head = self.store.live_nodes().get(nodes[0])
                master = head.address if head else None
        ctx = LaunchContext(
            replica_id=rec.id, model=model, profile=profile, host=self.settings.engine_host, port=port,
            gpus=tuple(rec.gpus.get(self.node, [])), node=self.node, node_rank=rank, nnodes=len(nodes),
            master_addr=master, master_port=master_port if master_port is not None else rec.master_port,
            api_key=rec.engine_secret if rank == 0 else None,  # only the head serves HTTP
            adapters=tuple(rec.adapters_wanted),  # an engine that loads adapters at launch (llama.cpp) reads it
            kv_events_port=kv_ports[0] if kv_ports else rec.kv_events_port,
            kv_replay_port=kv_ports[1] if kv_ports else rec.kv_replay_port,
            cpus=tuple(cpus if cpus is not None else rec.cpus),
            node_memory_mb=self.memory_mb, neighbours=neighbours,
        )
        spec = get_engine(profile.engine).command(ctx)
        if weights_path:
            spec = dataclasses.replace(spec, env={**spec.env, "HF_HUB_OFFLINE": "1"})
        if self.gpus and "CUDA_VISIBLE_DEVICES" not in spec.env:
            # On a GPU node, an engine sees only the GPUs placement gave it (none for a CPU replica), so
            # a CUDA build of llama.cpp cannot wander onto another replica's card.
            spec = dataclasses.replace(spec, env={**spec.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, ctx.gpus))})
        return spec


def launch_span(tracing, rec: ReplicaRecord, attempt: int, node: str, spec: LaunchSpec):
    """The span of one engine launch on this node (llmgw.tracing; docs/tracing.md), child of the
    control pass that created or placed the record (its `traceparent`), and the spec whose
    environment hands that span to the engine as its parent (TRACEPARENT, TRACESTATE: the
    OpenTelemetry convention for environment carriers). Tracing off: NO_SPAN and the spec as it was."""
    span = tracing.start("llmgw.launch", parent=rec.traceparent, kind="consumer", attributes={
        "llmgw.replica": rec.id, "llmgw.model": rec.model, "llmgw.profile": rec.profile, "llmgw.node": node,
        "llmgw.attempt": attempt})
    env = span.environment()
    return span, (dataclasses.replace(spec, env={**spec.env, **env}) if env else spec)


def ready_span(tracing, rec: ReplicaRecord, ready_at: float | None, node: str, launch: Launch | None):
    """The engine's start, from its spawn to its first good health probe, recorded when the loop
    sees it Ready (after the fact, from the recorded times): the child of its launch (the TRACEPARENT
    the engine was given) or, when this agent did not launch it (adopted after a restart), of the
    record's pass. Records that no traced pass made get none."""
    carrier = launch.spec.env if launch is not None and "TRACEPARENT" in launch.spec.env else None
    parent = carrier or rec.traceparent
    if parent is None or ready_at is None or rec.started_at is None:
        return NO_SPAN
    return tracing.record("llmgw.engine_start", rec.started_at, ready_at, parent=parent, attributes={
        "llmgw.replica": rec.id, "llmgw.model": rec.model, "llmgw.node": node, "llmgw.attempt": rec.attempt,
        "llmgw.url": rec.url or ""})
