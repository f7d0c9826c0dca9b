"""What a node is: its agent's heartbeat (GPUs, memory, the weights cache) and the operator's intent
for it (cordon, drain). Plain dataclasses with `to_dict`/`from_dict`, as `llmgw.state.records`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from llmgw.state.records import from_known

@dataclass(frozen=True)
class GPUDevice:
    index: int
    gpu_class: str  # normalised, e.g. "h100"
    memory_mb: int = 0
    # GPU health (llmgw.weights.gpuhealth): an unhealthy GPU gets no new replica; `health` says why.
    healthy: bool = True
    health: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> "GPUDevice":
        return from_known(cls, d)


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
    # The node's weights cache (docs/weights.md): the complete sources, where they live, the bytes free
    # there and the bytes a new download may take (free disk and LLMGW_WEIGHTS_BUDGET, once unused
    # weights are evicted). None: not reported (an older agent, or not read yet).
    weights: tuple["CachedWeights", ...] = ()
    weights_dir: str = ""
    weights_free: int | None = None
    weights_room: int | None = None
    weights_budget: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gpus"] = [asdict(g) for g in self.gpus]
        d["weights"] = [[w.source, w.size, w.last_used] for w in self.weights]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "NodeInfo":
        d = dict(d)
        d["gpus"] = tuple(GPUDevice.from_dict(g) for g in d.get("gpus") or ())
        d["weights"] = tuple(CachedWeights(str(w[0]), int(w[1]), float(w[2])) for w in d.get("weights") or ())
        return from_known(cls, d)

    def holds(self, source: str) -> bool:
        """The node has `source` complete in its cache."""
        return any(w.source == source for w in self.weights)


@dataclass(frozen=True)
class CachedWeights:
    """One complete source in a node's cache, as its heartbeat reports it."""

    source: str
    size: int  # bytes
    last_used: float = 0.0


@dataclass(frozen=True)
class NodeAdmin:
    """Operator intent for a node, kept without TTL: survives the node going away and coming back."""

    cordoned: bool = False
    draining: bool = False
