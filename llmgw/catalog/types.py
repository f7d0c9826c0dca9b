"""The catalog's types: what operators write (YAML), as frozen, fully resolved pydantic models.

This is the contract every part reads: `Catalog` > `Model` > `Profile` (> `GPURequest`,
`MetricMapping`, `LoraSlots`) and `Model` > `Adapter` (a LoRA adapter on the model's weights). Field-level rules (names, numbers, labels) live on the models; the rules across
fields and the engines' own refusals are in `llmgw.catalog.validate`, which builds these types.
Its field primitives are in `llmgw.catalog.fields`; `llmgw.catalog.spec` says which changes roll a
profile's replicas.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmgw.catalog.fields import ENV_RE, METRIC_RE, NAME_RE, Duration, SFloat, SInt, StrictModel
from llmgw.catalog.routing import RoutingSpec
from llmgw.catalog.slo import SloSpec
from llmgw.gpus import normalize_gpu_class

EngineName = Literal["vllm", "llamacpp", "sim", "external"]
ENGINE_NAMES: tuple[str, ...] = ("vllm", "llamacpp", "sim", "external")
# What the server behind an `external` profile is: a managed engine's kind (its paths, health path and
# metric names apply), or `openai` (None: any OpenAI-compatible API).
ServerKind = Literal["openai", "vllm", "llamacpp", "sim"]
SERVER_KINDS: tuple[str, ...] = ("openai", "vllm", "llamacpp", "sim")
# Profile fields only `engine: external` takes (llmgw.engines.external states its rules).
EXTERNAL_FIELDS = ("url", "served_name", "api_key_env", "server")

# Default `drain_timeout` (seconds): long enough for a long answer to finish streaming.
DRAIN_TIMEOUT = 120.0

# Per-engine defaults, applied under `defaults:` and the profile's own fields (docs/catalog.md).
# start_timeout: vLLM loads large weights and compiles CUDA graphs (minutes); llama.cpp mmaps a GGUF
# (seconds to a couple of minutes on CPU). capacity: concurrent requests one replica serves well --
# vLLM batches continuously, llama.cpp has a few slots (-np), the simulator sits in between.
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "vllm": {"start_timeout": 900.0, "capacity": 64},
    "llamacpp": {"start_timeout": 120.0, "capacity": 4},
    "sim": {"start_timeout": 60.0, "capacity": 16},
    # llmgw runs no replica of an external server: one endpoint per url instead.
    "external": {"replicas": 0, "capacity": 32},
}


class GPURequest(StrictModel):
    """GPUs one replica needs on each node it spans: `{class: h100, count: 2}`."""

    gpu_class: str = Field(alias="class", min_length=1)
    count: SInt = Field(default=1, ge=1)

    @field_validator("gpu_class")
    @classmethod
    def _normalise(cls, v: str) -> str:
        try:
            out = normalize_gpu_class(v)
        except Exception as e:  # noqa: BLE001 - e.g. a malformed LLMGW_GPU_CLASS_MAP: say so, don't crash
            raise ValueError(f"cannot normalise GPU class {v!r}: {e}") from None
        if not out:
            raise ValueError(f"GPU class {v!r} is not a GPU class")
        return out


class MetricMapping(StrictModel):
    """Names of the three series the router needs. None/blank = not reported (unknown)."""

    running: str | None = None
    waiting: str | None = None
    kv_usage: str | None = None

    @field_validator("running", "waiting", "kv_usage")
    @classmethod
    def _prometheus_name(cls, v: str | None) -> str | None:
        if v and not METRIC_RE.match(v):
            raise ValueError(f"{v!r} is not a legal Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
        return v

    def is_empty(self) -> bool:
        return not (self.running or self.waiting or self.kv_usage)


# Scale to zero: with `autoscale.min: 0`, a profile that got no request this long goes to 0 replicas.
IDLE_AFTER = 300.0


class Autoscale(StrictModel):
    """`autoscale:` of a profile: the replica count follows the load (docs/autoscaling.md). The rules
    across fields (min <= max, idle_after only with min 0) are checked by `llmgw.catalog.validate`,
    which can point at the field; the stored (resolved) form only has to be well-typed."""

    min: SInt = Field(default=1, ge=0)  # 0: scale to zero when idle
    max: SInt = Field(ge=1)  # no default: it bounds what the profile may take of the fleet
    target: SFloat = Field(default=0.7, gt=0, le=1, allow_inf_nan=False)  # wanted load per replica
    scale_up_after: Duration = Field(default=5.0, gt=0, allow_inf_nan=False)
    scale_down_after: Duration = Field(default=120.0, gt=0, allow_inf_nan=False)
    # Resolved: IDLE_AFTER when min is 0 and it is omitted; None (never idles to zero) when min > 0.
    idle_after: Duration | None = Field(default=None, gt=0, allow_inf_nan=False)
    cold_start_timeout: Duration = Field(default=180.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _resolve_idle_after(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("min", 1) == 0 and data.get("idle_after") is None:
            data = {**data, "idle_after": IDLE_AFTER}
        return data


# vLLM's `--max-lora-rank` default; the engines state which values they take (llmgw.engines).
MAX_LORA_RANK = 16
# Engines whose replica loads its adapters at launch (llama.cpp's --lora-scaled): a change of the
# adapters a profile serves restarts its replicas. The others load and unload them at run time.
ADAPTERS_AT_LAUNCH = frozenset({"llamacpp"})


class LoraSlots(StrictModel):
    """`lora:` of a profile: its replicas serve LoRA adapters. `max_loras` is how many one replica
    holds at once (vLLM: adapters in one batch, its GPU slots; llama.cpp: adapters it is launched
    with); `max_lora_rank` the largest rank it takes; `max_cpu_loras` (vLLM only) how many it keeps
    in CPU memory, ready to swap in."""

    max_loras: SInt = Field(default=1, ge=1)
    max_lora_rank: SInt = Field(default=MAX_LORA_RANK, ge=1)
    max_cpu_loras: SInt | None = Field(default=None, ge=1)


class Profile(StrictModel):
    """One way to serve a model: engine, replica count, hardware and routing tier."""

    name: str = Field(min_length=1)
    engine: EngineName
    replicas: SInt = Field(default=1, ge=0)
    gpu: GPURequest | None = None  # None: runs on the CPU
    # `cpu`: the profile runs on CPUs, said explicitly (vLLM's CPU build; an engine that needs a GPU
    # refuses a profile with neither `gpu` nor this). None: whatever `gpu` says.
    device: Literal["cpu"] | None = None
    # `device: cpu` on vLLM: the cores one replica uses, each bound to its own core (its agent picks
    # the node's least used ones), so two replicas on one machine do not fight over the same cores.
    # None: 1.
    threads: SInt | None = Field(default=None, ge=1)
    tensor_parallel: SInt = Field(default=1, ge=1)
    pipeline_parallel: SInt = Field(default=1, ge=1)
    nodes: SInt = Field(default=1, ge=1)
    priority: SInt = 0  # the routing tier
    # GPU sharing: the order placement serves profiles when GPUs are short, and who may preempt whom
    # (strictly higher only; docs/autoscaling.md). `priority` stays the tie-break.
    scheduling_priority: SInt = 0
    # None: a fixed `replicas` count. Set: the count follows the load within [min, max]; `replicas`
    # then holds `autoscale.min`, the count when nothing is known about the load.
    autoscale: Autoscale | None = None
    weight: SFloat = Field(default=1.0, gt=0, allow_inf_nan=False)
    pool: str = "default"
    node_selector: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    capacity: SInt | None = Field(default=None, ge=1)  # filled from ENGINE_DEFAULTS when omitted
    metrics: MetricMapping | None = None
    # None: serves no LoRA adapters. Set: its replicas hold the model's adapters (Model.adapters).
    lora: LoraSlots | None = None
    # Precise prefix routing: the engine publishes its KV cache events (vLLM's --kv-events-config, on
    # ports its agent chooses) and every gateway indexes what each replica holds from them.
    kv_events: bool = False
    # The KV cache one replica holds, in tokens: how much of what the gateway sent there its prefix
    # cache can still hold (the gateway's index is sized to it). None: the engine's own figure (vLLM's
    # vllm:cache_config_info), else a default (llmgw.state.records.DEFAULT_KV_TOKENS).
    kv_cache_tokens: SInt | None = Field(default=None, ge=256)
    # llama.cpp: MiB of llama-server's host-memory prompt cache per replica (`--cache-ram`), which keeps
    # the KV of the prompts its slots gave up, so an answer evicted from a slot resumes without computing
    # its prompt again; 0: none. None: a share of the node's memory (llmgw.engines.llamacpp.cache_ram_mib).
    cache_ram: SInt | None = Field(default=None, ge=0)
    start_timeout: Duration = Field(default=120.0, gt=0, allow_inf_nan=False)
    # A planned stop (rolling update, scale-down, drain, removal) lets in-flight requests finish for up
    # to this long (seconds) after every gateway stopped sending new ones; 0 = stop at once.
    drain_timeout: Duration = Field(default=DRAIN_TIMEOUT, ge=0, allow_inf_nan=False)
    # Overrides the model's `source` for this profile (a GGUF file for the llama.cpp tier of a model
    # vLLM loads from Hugging Face). None: the model's source. LaunchContext applies it.
    source: str | None = None
    # engine: external only (llmgw.engines.external): where the server is, the name it serves the
    # model under (default: the model's name), the NAME of the gateway's environment variable that
    # holds its API key (never the key), and what kind of server it is.
    url: str | list[str] | None = None
    served_name: str | None = None
    api_key_env: str | None = None
    server: ServerKind | None = None

    @model_validator(mode="before")
    @classmethod
    def _fill_engine_defaults(cls, data: Any) -> Any:
        """Fill omitted fields from the engine's defaults, and `gpu.count` from the parallelism."""
        if not isinstance(data, dict):
            return data
        engine = data.get("engine")
        defaults = ENGINE_DEFAULTS.get(engine) if isinstance(engine, str) else None
        if defaults:
            data = {**defaults, **{k: v for k, v in data.items() if not (k == "capacity" and v is None)}}
        auto = data.get("autoscale")
        if "replicas" not in data and isinstance(auto, (dict, Autoscale)):
            floor = auto.get("min", 1) if isinstance(auto, dict) else auto.min
            if type(floor) is int and floor >= 0:
                data = {**data, "replicas": floor}
        gpu = data.get("gpu")
        if isinstance(gpu, dict) and "count" not in gpu:
            tp, pp, nodes = (data.get(k, 1) for k in ("tensor_parallel", "pipeline_parallel", "nodes"))
            if all(type(x) is int and x >= 1 for x in (tp, pp, nodes)) and (tp * pp) % nodes == 0:
                data = {**data, "gpu": {**gpu, "count": max(1, tp * pp // nodes)}}
        return data

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v: Any) -> Any:
        if v is None or v == "cpu":
            return v
        if v == "gpu":
            raise ValueError("a GPU is asked for with `gpu: {class: ..., count: ...}`; `device` only says `cpu`")
        raise ValueError(f"must be `cpu` (run on CPUs), got {v!r}")

    @property
    def cpu_threads(self) -> int:
        """Cores one CPU replica of vLLM binds (`threads`, default 1)."""
        return self.threads or 1

    @field_validator("name", "pool")
    @classmethod
    def _simple_name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not key or any(c in key for c in "=, \t") or any(c in value for c in ", \t"):
                raise ValueError(
                    f"label {key}={value!r} can never match a node: keys need no '=', ',' or spaces, "
                    "values no ',' or spaces"
                )
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not ENV_RE.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return v

    @field_validator("url", mode="before")
    @classmethod
    def _url_shape(cls, v: Any) -> Any:
        # One message for both shapes, rather than one per member of the union.
        if v is None or isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(u, str) for u in v)):
            return v
        raise ValueError("must be a url or a non-empty list of urls (strings)")

    @field_validator("served_name")
    @classmethod
    def _served(cls, v: str | None) -> str | None:
        return v if v is None else _check_served_name(v)

    @property
    def urls(self) -> list[str]:
        """An external profile's urls, as a list (one or several may be written)."""
        if self.url is None:
            return []
        return [self.url] if isinstance(self.url, str) else list(self.url)

    @property
    def min_replicas(self) -> int:
        """The fewest replicas the profile keeps: `autoscale.min`, or a fixed `replicas` count (which
        preemption therefore never takes from)."""
        return self.autoscale.min if self.autoscale else self.replicas

    @property
    def gpus_per_replica(self) -> int:
        """GPUs one replica holds across all its nodes (0 on the CPU)."""
        return self.gpu.count * self.nodes if self.gpu else 0


class _Served(StrictModel):
    """Something clients name as `model`: a name and more names (aliases) for it."""

    name: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _served_name(cls, v: str) -> str:
        return _check_served_name(v)

    @field_validator("aliases")
    @classmethod
    def _alias_names(cls, v: list[str]) -> list[str]:
        for a in v:
            _check_served_name(a)
        return v

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]


class Adapter(_Served):
    """A LoRA adapter on its model's weights, served under its own name by the model's profiles
    that have `lora:` (or the ones it names in `profiles`). `replicas` is how many replicas hold it
    at least (`all`: every replica of those profiles); busier adapters get more. `scale` is what a
    llama.cpp replica applies it at."""

    source: str = Field(min_length=1)
    rank: SInt = Field(ge=1)
    replicas: SInt | Literal["all"] = 1
    profiles: list[str] = Field(default_factory=list)  # empty: every profile of the model with `lora:`
    scale: SFloat = Field(default=1.0, allow_inf_nan=False)

    @field_validator("replicas", mode="before")
    @classmethod
    def _count_or_all(cls, v: Any) -> Any:
        if v == "all" or (type(v) is int and v >= 0):
            return v
        raise ValueError("must be a whole number >= 0 or `all` (every replica of the profiles that serve it)")

    @property
    def pinned(self) -> bool:
        """Held by every replica of the profiles that serve it."""
        return self.replicas == "all"


class Model(_Served):
    source: str = ""
    profiles: list[Profile] = Field(default_factory=list)
    adapters: list[Adapter] = Field(default_factory=list)
    routing: RoutingSpec | None = None  # llmgw.catalog.routing
    slo: SloSpec | None = None  # llmgw.catalog.slo: its requests' default latency targets

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)

    def source_for(self, profile: Profile) -> str:
        """What `profile`'s engine loads: the profile's own source, else the model's."""
        return profile.source or self.source

    def adapter(self, name_or_alias: str) -> Adapter | None:
        return next((a for a in self.adapters if name_or_alias in a.names), None)

    def adapters_for(self, profile: Profile) -> list[Adapter]:
        """The adapters `profile`'s replicas serve: none without `lora:`; else those naming it in
        `profiles`, and those naming no profile."""
        if profile.lora is None:
            return []
        return [a for a in self.adapters if not a.profiles or profile.name in a.profiles]


def _check_served_name(v: str) -> str:
    # Names travel in JSON bodies, URLs and engine flags (--served-model-name, -a a,b): no spaces,
    # commas or control characters.
    if not v or len(v) > 256 or any(c.isspace() or c == "," or ord(c) < 32 for c in v):
        raise ValueError(f"{v!r} must be 1-256 characters without spaces, commas or control characters")
    return v


class Catalog(StrictModel):
    models: list[Model] = Field(default_factory=list)

    def model(self, name: str) -> Model | None:
        return next((m for m in self.models if m.name == name), None)

    def resolve(self, name_or_alias: str) -> Model | None:
        return next((m for m in self.models if name_or_alias in m.names), None)

    def resolve_adapter(self, name_or_alias: str) -> tuple[Model, Adapter] | None:
        """The adapter a client names (by its name or an alias), with its base model."""
        return next(((m, a) for m in self.models for a in m.adapters if name_or_alias in a.names), None)

    def profiles(self) -> list[tuple[Model, Profile]]:
        return [(m, p) for m in self.models for p in m.profiles]

    def total_replicas(self) -> int:
        return sum(p.replicas for m in self.models for p in m.profiles)

    def canonical(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    def hash(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
