"""The records llmgw keeps in Redis: nodes, replicas, load samples and published endpoints.

They are plain dataclasses with `to_dict`/`from_dict`; unknown keys from a newer writer are ignored
so a mixed-version fleet keeps working. Records hold facts only; the state a user sees is derived
from them by `llmgw.state.replica_state.derive`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from llmgw.state.keys import REPLICA_STOPPED_ON_PREFIX

T = TypeVar("T")


def _from_dict(cls: type[T], data: dict[str, Any]) -> T:
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class GPUDevice:
    index: int
    gpu_class: str  # normalised, e.g. "h100"
    memory_mb: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "GPUDevice":
        return _from_dict(cls, d)


@dataclass(frozen=True)
class NodeInfo:
    """What a node agent reports in its heartbeat (key with TTL: absent means not live)."""

    name: str
    address: str = "127.0.0.1"  # where other machines reach this node's engines
    cpu_cores: int = 1
    memory_mb: int = 0
    gpus: tuple[GPUDevice, ...] = ()
    pool: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_at: float = 0.0
    agent_started_at: float = 0.0
    agent_pid: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gpus"] = [asdict(g) for g in self.gpus]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "NodeInfo":
        d = dict(d)
        d["gpus"] = tuple(GPUDevice.from_dict(g) for g in d.get("gpus") or ())
        return _from_dict(cls, d)


@dataclass(frozen=True)
class NodeAdmin:
    """Operator intent for a node, kept without TTL: survives the node going away and coming back."""

    cordoned: bool = False
    draining: bool = False


# Fields of a replica record, by who writes them. Each side writes only its own fields (HSET of
# single fields), which is what lets the control plane and the agent update one record concurrently.
CONTROL_FIELDS = (
    "id", "model", "profile", "spec_hash", "node", "nodes", "gpus", "created_at",
    "pending_reason", "stop_requested_at", "stop_reason", "launch_dispatched_at",
)
AGENT_FIELDS = (
    "port", "url", "pid", "pid_start", "engine_pid", "started_at", "attempt", "exit_code",
    "exit_signal", "exited_at", "last_probe_at", "last_probe_ok", "probe_error", "first_ready_at",
    "restarts", "failure_times", "next_restart_at", "log_tail", "stopped_at", "adopted_at",
    "master_port",
)
# Plus one field per node, `stopped_on:<node>` (llmgw.state.keys.replica_stopped_on), written by each node's
# agent of a multi-node replica; read back as `ReplicaRecord.stopped_nodes`.


@dataclass
class ReplicaRecord:
    # --- written by the control plane -----------------------------------------------------------
    id: str
    model: str
    profile: str
    spec_hash: str = ""  # hash of the effective profile spec; a change triggers a rolling update
    node: str | None = None  # the head node (serves HTTP); None while Pending
    nodes: list[str] = field(default_factory=list)  # all nodes of a multi-node replica, head first
    gpus: dict[str, list[int]] = field(default_factory=dict)  # node -> GPU indexes allocated
    created_at: float = 0.0
    pending_reason: str | None = None  # why it could not be placed, for humans
    stop_requested_at: float | None = None
    stop_reason: str | None = None
    launch_dispatched_at: float | None = None
    # --- written by the node agent (facts about the process) ------------------------------------
    port: int | None = None
    url: str | None = None  # http://address:port of the head's engine
    pid: int | None = None  # the supervising shim: session and process-group leader
    pid_start: int | None = None  # /proc/<pid>/stat field 22, to tell a reused pid apart
    engine_pid: int | None = None
    started_at: float | None = None  # start of the current attempt
    attempt: int = 0  # how many times the agent has started it
    exit_code: int | None = None  # of the last attempt; negative = killed by that signal
    exit_signal: int | None = None
    exited_at: float | None = None
    last_probe_at: float | None = None
    last_probe_ok: bool | None = None
    probe_error: str | None = None
    first_ready_at: float | None = None  # of the current attempt
    restarts: int = 0
    failure_times: list[float] = field(default_factory=list)  # recent unexpected exits
    next_restart_at: float | None = None
    log_tail: str | None = None
    stopped_at: float | None = None  # process confirmed gone after a stop request
    adopted_at: float | None = None  # when a restarted agent took over a running engine
    # Multi-node: the torch.distributed rendezvous port the head chose for its current attempt (members
    # join `node address:master_port`, and restart their part when the head's `attempt` changes).
    master_port: int | None = None
    # --- loaded, never stored under this name ------------------------------------------------------
    # Nodes whose agent confirmed its part stopped (the `stopped_on:<node>` fields), sorted.
    stopped_nodes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["stopped_nodes"]  # stored as one field per node, written by each agent
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ReplicaRecord":
        stopped = sorted(k[len(REPLICA_STOPPED_ON_PREFIX):] for k, v in d.items()
                         if k.startswith(REPLICA_STOPPED_ON_PREFIX) and v is not None)
        rec = _from_dict(cls, {k: v for k, v in d.items() if k != "stopped_nodes"})
        rec.stopped_nodes = stopped
        return rec

    @property
    def all_nodes(self) -> list[str]:
        """Every node this replica runs on, head first (one for all but multi-node replicas)."""
        return list(self.nodes) or ([self.node] if self.node else [])

    @property
    def running(self) -> bool:
        """The agent has a live process for the current attempt."""
        return self.started_at is not None and (
            self.exited_at is None or self.exited_at < self.started_at
        )


@dataclass(frozen=True)
class LoadRecord:
    """One scrape of one replica's /metrics, mapped to llmgw's three numbers.

    None means unknown (series absent or not mapped), never zero: the router must not mistake an
    engine that does not report KV usage for an idle one.
    """

    replica_id: str
    ts: float
    ok: bool
    error: str | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoadRecord":
        return _from_dict(cls, d)


@dataclass(frozen=True)
class EndpointInfo:
    """One routable replica, as published to the gateway (the seed's endpoint.Info)."""

    id: str
    url: str
    models: tuple[str, ...]  # canonical name first, then aliases
    engine: str
    pool: str = "default"
    weight: float = 1.0
    priority: int = 0
    capacity: int | None = None  # concurrent requests one replica serves well
    served_name: str = ""  # the name the engine answers to; the gateway rewrites `model` to it
    model: str = ""  # canonical model name
    profile: str = ""
    node: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["models"] = list(self.models)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EndpointInfo":
        d = dict(d)
        d["models"] = tuple(d.get("models") or ())
        return _from_dict(cls, d)

