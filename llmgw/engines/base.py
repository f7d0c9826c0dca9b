"""The engine adapter interface: one module per engine (vllm.py, llamacpp.py, sim.py).

An adapter turns (replica, profile, port, GPU indexes, node) into a command line and environment,
declares whether it can serve without a GPU, says what it refuses, and names its default metric
mapping. Adapters are pure: they build data, the node agent runs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from llmgw.catalog import MetricMapping, Model, Profile
from llmgw.errors import Problem


@dataclass(frozen=True)
class LaunchContext:
    replica_id: str
    model: Model
    profile: Profile
    host: str  # address the engine binds to
    port: int
    gpus: tuple[int, ...] = ()  # GPU indexes on this node (become CUDA_VISIBLE_DEVICES)
    node: str = ""
    node_rank: int = 0  # 0 = head (serves HTTP) for multi-node replicas
    nnodes: int = 1
    master_addr: str | None = None  # head node's address, for multi-node


@dataclass(frozen=True)
class LaunchSpec:
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # added to the agent's environment
    serves_http: bool = True  # False for multi-node workers (vLLM --headless)
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    start_timeout: float = 120.0  # seconds from start until healthy before it counts as failed


class EngineAdapter(ABC):
    name: ClassVar[str]
    needs_gpu: ClassVar[bool]  # True: a profile without `gpu` is an error
    supports_tensor_parallel: ClassVar[bool]
    supports_multi_node: ClassVar[bool]
    default_metrics: ClassVar[MetricMapping]
    # Series tried, in order, when the mapped KV name is absent (e.g. vLLM's pre-0.9.2 name).
    kv_fallbacks: ClassVar[tuple[str, ...]] = ()

    def refusals(self, profile: Profile) -> list[Problem]:
        """What this engine refuses in a profile; paths are relative to the profile."""
        problems = []
        if self.needs_gpu and profile.gpu is None:
            problems.append(Problem("gpu", f"{self.name} needs a GPU class"))
        if not self.supports_tensor_parallel and profile.tensor_parallel > 1:
            problems.append(Problem("tensor_parallel", f"{self.name} does not support tensor parallelism"))
        if not self.supports_multi_node and profile.nodes > 1:
            problems.append(Problem("nodes", f"{self.name} does not support multi-node replicas"))
        return problems

    def effective_metrics(self, profile: Profile) -> MetricMapping:
        """The seed's rule: empty mapping = this engine's defaults; one naming its own Running metric
        is complete (blanks stay blank); otherwise blanks are filled from the defaults."""
        m = profile.metrics
        if m is None or m.is_empty():
            return self.default_metrics
        if m.running:
            return m
        d = self.default_metrics
        return MetricMapping(running=d.running, waiting=m.waiting or d.waiting, kv_usage=m.kv_usage or d.kv_usage)

    @abstractmethod
    def command(self, ctx: LaunchContext) -> LaunchSpec:
        """The process to run for this replica on this node."""
