"""The catalog's types: what operators write (YAML), as frozen, fully resolved pydantic models.

This is the contract every part reads: `Catalog` > `Model` > `Profile` (> `GPURequest`,
`MetricMapping`). Field-level rules (names, numbers, labels) live on the models; the rules across
fields and the engines' own refusals are in `llmgw.catalog.validate`, which builds these types.
`profile_spec_hash` says which changes roll a profile's replicas.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from llmgw.gpus import normalize_gpu_class

EngineName = Literal["vllm", "llamacpp", "sim"]
ENGINE_NAMES: tuple[str, ...] = ("vllm", "llamacpp", "sim")

# Per-engine defaults, applied under `defaults:` and the profile's own fields (docs/catalog.md).
# start_timeout: vLLM loads large weights and compiles CUDA graphs (minutes); llama.cpp mmaps a GGUF
# (seconds to a couple of minutes on CPU). capacity: concurrent requests one replica serves well --
# vLLM batches continuously, llama.cpp has a few slots (-np), the simulator sits in between.
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "vllm": {"start_timeout": 900.0, "capacity": 64},
    "llamacpp": {"start_timeout": 120.0, "capacity": 4},
    "sim": {"start_timeout": 60.0, "capacity": 16},
}

# Profile fields whose `defaults:` value is merged key by key with the profile's (profile wins per key).

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_METRIC_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")



# Strict numbers: YAML's `replicas: yes` or `replicas: "2"` is a type error, not a silent coercion.
# (Strings are never coerced from numbers by pydantic; lists stay lax so Python callers may pass tuples.)
SInt = Annotated[int, Strict()]
SFloat = Annotated[float, Strict()]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)



class GPURequest(_Strict):
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


class MetricMapping(_Strict):
    """Names of the three series the router needs. None/blank = not reported (unknown)."""

    running: str | None = None
    waiting: str | None = None
    kv_usage: str | None = None

    @field_validator("running", "waiting", "kv_usage")
    @classmethod
    def _prometheus_name(cls, v: str | None) -> str | None:
        if v and not _METRIC_RE.match(v):
            raise ValueError(f"{v!r} is not a legal Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
        return v

    def is_empty(self) -> bool:
        return not (self.running or self.waiting or self.kv_usage)


class Profile(_Strict):
    """One way to serve a model: engine, replica count, hardware and routing tier."""

    name: str = Field(min_length=1)
    engine: EngineName
    replicas: SInt = Field(default=1, ge=0)
    gpu: GPURequest | None = None  # None: runs on the CPU
    tensor_parallel: SInt = Field(default=1, ge=1)
    pipeline_parallel: SInt = Field(default=1, ge=1)
    nodes: SInt = Field(default=1, ge=1)
    priority: SInt = 0
    weight: SFloat = Field(default=1.0, gt=0, allow_inf_nan=False)
    pool: str = "default"
    node_selector: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    capacity: SInt | None = Field(default=None, ge=1)  # filled from ENGINE_DEFAULTS when omitted
    metrics: MetricMapping | None = None
    start_timeout: SFloat = Field(default=120.0, gt=0, allow_inf_nan=False)
    # Overrides the model's `source` for this profile (a GGUF file for the llama.cpp tier of a model
    # vLLM loads from Hugging Face). None: the model's source. LaunchContext applies it.
    source: str | None = None

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
        gpu = data.get("gpu")
        if isinstance(gpu, dict) and "count" not in gpu:
            tp, pp, nodes = (data.get(k, 1) for k in ("tensor_parallel", "pipeline_parallel", "nodes"))
            if all(type(x) is int and x >= 1 for x in (tp, pp, nodes)) and (tp * pp) % nodes == 0:
                data = {**data, "gpu": {**gpu, "count": max(1, tp * pp // nodes)}}
        return data

    @field_validator("name", "pool")
    @classmethod
    def _simple_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
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
            if not _ENV_RE.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return v

    @property
    def gpus_per_replica(self) -> int:
        """GPUs one replica holds across all its nodes (0 on the CPU)."""
        return self.gpu.count * self.nodes if self.gpu else 0


class Model(_Strict):
    name: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    source: str = ""
    profiles: list[Profile] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _model_name(cls, v: str) -> str:
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

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)

    def source_for(self, profile: Profile) -> str:
        """What `profile`'s engine loads: the profile's own source, else the model's."""
        return profile.source or self.source


def _check_served_name(v: str) -> str:
    # Names travel in JSON bodies, URLs and engine flags (--served-model-name, -a a,b): no spaces,
    # commas or control characters.
    if not v or len(v) > 256 or any(c.isspace() or c == "," or ord(c) < 32 for c in v):
        raise ValueError(f"{v!r} must be 1-256 characters without spaces, commas or control characters")
    return v


class Catalog(_Strict):
    models: list[Model] = Field(default_factory=list)

    def model(self, name: str) -> Model | None:
        return next((m for m in self.models if m.name == name), None)

    def resolve(self, name_or_alias: str) -> Model | None:
        return next((m for m in self.models if name_or_alias in m.names), None)

    def profiles(self) -> list[tuple[Model, Profile]]:
        return [(m, p) for m in self.models for p in m.profiles]

    def total_replicas(self) -> int:
        return sum(p.replicas for m in self.models for p in m.profiles)

    def canonical(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    def hash(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# Profile fields that shape the launched process: a change of any of them rolls the replicas; every
# other field is read live by the router, the planner or the agent.
LAUNCH_FIELDS = frozenset({"engine", "gpu", "tensor_parallel", "pipeline_parallel", "nodes", "args", "env", "capacity"})


def profile_spec_hash(model: Model, profile: Profile) -> str:
    """Hash of what shapes the launched process, so a change of it (and only that) rolls the replicas.

    Covered: engine, source (the profile's own or the model's), gpu, tensor/pipeline parallelism,
    nodes, args, env, capacity (it becomes -np / --max-num-seqs) and the model's name and aliases (they
    become served names). Not covered, because the router, planner or agent read them live: replicas,
    priority, weight, pool and node_selector (a node that no longer matches is handled as outdated by
    the planner), metrics and start_timeout."""
    spec = profile.model_dump(
        mode="json",
        by_alias=True,
        include=set(LAUNCH_FIELDS),
    )
    spec["_model"] = {"name": model.name, "aliases": model.aliases, "source": model.source_for(profile)}
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
