"""The catalog: what operators write (YAML), parsed and validated into frozen types.

This is the contract every part reads. `parse_catalog(data, source)` returns a `Catalog` or raises
`CatalogInvalid` listing every problem at once, each with its field path, so a catalog that would fail
later (a vLLM profile without a GPU, a GPU count that cannot hold the parallelism, a typo in a key) is
refused before it is applied. The returned catalog is fully resolved: top-level `defaults:` and the
per-engine defaults are folded into every profile, so readers never apply defaults themselves.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from llmgw.errors import CatalogInvalid, Problem

EngineName = Literal["vllm", "llamacpp", "sim"]
ENGINE_NAMES: tuple[str, ...] = ("vllm", "llamacpp", "sim")

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
}

# Profile fields whose `defaults:` value is merged key by key with the profile's (profile wins per key).
MERGED_MAPS = ("env", "node_selector", "gpu")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_METRIC_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PKG_RE = re.compile(r"^pkg:([A-Za-z0-9][A-Za-z0-9._-]*)/(.+)$")

# Flags llmgw sets itself on every engine command line; passing them in `args` would fight the
# adapter (two --port flags, a served name the router does not know, parallelism the GPU
# allocation does not match).
_RESERVED_ARGS: dict[str, str] = {
    "--host": "llmgw binds each replica itself (LLMGW_ENGINE_HOST)",
    "--port": "llmgw gives each replica its own port",
    "--served-model-name": "llmgw serves the model under its name and aliases",
    "-a": "llmgw serves the model under its name and aliases",
    "--alias": "llmgw serves the model under its name and aliases",
    "-m": "the model file comes from the model's `source`",
    "--model": "the model comes from the model's `source`",
    "-tp": "use the profile's `tensor_parallel`",
    "--tensor-parallel-size": "use the profile's `tensor_parallel`",
    "-pp": "use the profile's `pipeline_parallel`",
    "--pipeline-parallel-size": "use the profile's `pipeline_parallel`",
    "--nnodes": "use the profile's `nodes`",
    "-np": "set the profile's `capacity` instead (llmgw passes it to llama-server as -np)",
    "--parallel": "set the profile's `capacity` instead (llmgw passes it to llama-server as -np)",
    "--node-rank": "llmgw assigns node ranks to multi-node replicas",
    "--master-addr": "llmgw sets the head address of multi-node replicas",
    "--api-key": "the gateway authenticates clients; an engine key would refuse the gateway's own requests",
}
_RESERVED_ENV: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "llmgw pins each replica to the GPUs it allocated",
}


# Strict numbers: YAML's `replicas: yes` or `replicas: "2"` is a type error, not a silent coercion.
# (Strings are never coerced from numbers by pydantic; lists stay lax so Python callers may pass tuples.)
SInt = Annotated[int, Strict()]
SFloat = Annotated[float, Strict()]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _normalize_gpu(name: str) -> str:
    from llmgw.gpus import normalize_gpu_class  # the one normaliser shared with node discovery

    return normalize_gpu_class(name)


class GPURequest(_Strict):
    """GPUs one replica needs on each node it spans: `{class: h100, count: 2}`."""

    gpu_class: str = Field(alias="class", min_length=1)
    count: SInt = Field(default=1, ge=1)

    @field_validator("gpu_class")
    @classmethod
    def _normalise(cls, v: str) -> str:
        try:
            out = _normalize_gpu(v)
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
    # A planned stop (rolling update, scale-down, drain, removal) lets in-flight requests finish for up
    # to this long (seconds) after every gateway stopped sending new ones; 0 = stop at once.
    drain_timeout: SFloat = Field(default=DRAIN_TIMEOUT, ge=0, allow_inf_nan=False)
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
    def on_gpu(self) -> bool:
        return self.gpu is not None

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
    the planner), metrics, start_timeout and drain_timeout."""
    spec = profile.model_dump(
        mode="json",
        by_alias=True,
        include=set(LAUNCH_FIELDS),
    )
    spec["_model"] = {"name": model.name, "aliases": model.aliases, "source": model.source_for(profile)}
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# --- turning pydantic's errors into one clear line each ------------------------------------------

PROFILE_FIELDS: tuple[str, ...] = tuple(Profile.model_fields)
_KNOWN_KEYS: dict[str, tuple[str, ...]] = {
    "catalog": ("models", "defaults"),
    "model": ("name", "aliases", "source", "profiles"),
    "profile": PROFILE_FIELDS,
    "gpu": ("class", "count"),
    "metrics": ("running", "waiting", "kv_usage"),
}


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _join(prefix: str, rest: str) -> str:
    if not rest:
        return prefix
    if not prefix:
        return rest
    return prefix + ("" if rest.startswith("[") else ".") + rest


def _known_for(loc: tuple[Any, ...], kind: str) -> tuple[str, ...]:
    parents = [p for p in loc[:-1] if isinstance(p, str)]
    if parents and parents[-1] in ("gpu", "metrics"):
        return _KNOWN_KEYS[parents[-1]]
    if kind == "model" and parents and parents[0] == "profiles":
        return _KNOWN_KEYS["profile"]
    return _KNOWN_KEYS.get(kind, ())


def _reason(err: dict, kind: str) -> str:
    """One line a person can act on, from one pydantic error (never its wording or its URL)."""
    t, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    loc = err["loc"]
    if t == "extra_forbidden":
        key = str(loc[-1])
        known = _known_for(loc, kind)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else (f" (known: {', '.join(known)})" if known else "")
        return f"unknown field '{key}'{hint}"
    if t == "missing":
        return "required field is missing"
    if t == "literal_error":
        return f"unknown engine {value!r} (expected one of: {', '.join(ENGINE_NAMES)})"
    if t in ("int_type", "int_parsing", "int_from_float"):
        return f"must be a whole number, got {_describe(value)}"
    if t in ("float_type", "float_parsing"):
        return f"must be a number, got {_describe(value)}"
    if t == "string_type":
        where = "a key" if loc and loc[-1] == "[key]" else "a string"
        hint = " (quote it in YAML)" if isinstance(value, (int, float)) else ""
        return f"must be {where}, got {_describe(value)}{hint}"
    if t in ("dict_type", "model_type", "model_attributes_type", "mapping_type"):
        return f"must be a mapping, got {_describe(value)}"
    if t in ("list_type", "tuple_type"):
        return f"must be a list, got {_describe(value)}"
    if t == "greater_than_equal":
        return f"must be at least {ctx.get('ge')}, got {value}"
    if t == "greater_than":
        return f"must be greater than {ctx.get('gt')}, got {value}"
    if t == "string_too_short":
        return "must not be empty"
    if t == "value_error":
        return str(ctx.get("error", err["msg"]))
    if t in ("finite_number",):
        return f"must be a finite number, got {value}"
    return str(err["msg"]).rstrip(".")


def _pydantic_problems(e: ValidationError, prefix: str, kind: str) -> list[Problem]:
    return [
        Problem(_join(prefix, _loc_to_path(err["loc"])), _reason(err, kind))
        for err in e.errors(include_url=False)
    ]


# --- the rules ---------------------------------------------------------------------------------


def _merge_defaults(defaults: dict, profile: dict) -> dict:
    merged = {**defaults, **profile}
    for key in MERGED_MAPS:
        d, p = defaults.get(key), profile.get(key)
        if isinstance(d, dict) and isinstance(p, dict):
            merged[key] = {**d, **p}
    return merged


def _validate_defaults(raw: Any, problems: list[Problem]) -> dict:
    """The valid part of `defaults:`; each invalid key is reported once, here, and not merged."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(Problem("defaults", f"must be a mapping of profile fields, got {_describe(raw)}"))
        return {}
    out = dict(raw)
    for key, why in (("name", "a profile's name cannot have a default"),
                     ("source", "a source belongs to a model (or one profile), it cannot have a default")):
        if key in out:
            problems.append(Problem(f"defaults.{key}", why))
            del out[key]
    probe = {"engine": "sim", **out, "name": "defaults"}
    try:
        Profile.model_validate(probe)
    except ValidationError as e:
        bad = set()
        for p, err in zip(_pydantic_problems(e, "defaults", "profile"), e.errors(include_url=False)):
            problems.append(p)
            bad.add(err["loc"][0])
        out = {k: v for k, v in out.items() if k not in bad}
    return out


def _args_problems(args: list[str], path: str) -> list[Problem]:
    out = []
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in _RESERVED_ARGS:
            out.append(Problem(f"{path}[{i}]", f"'{flag}' is set by llmgw: {_RESERVED_ARGS[flag]}"))
    return out


def _profile_problems(p: Profile, path: str) -> list[Problem]:
    """Rules across fields of one profile; the engine's own refusals come from its adapter."""
    from llmgw.engines import ENGINES  # the adapters import this module: import them late

    adapter = ENGINES[p.engine]
    try:
        refusals = list(adapter.refusals(p))
    except Exception as e:  # noqa: BLE001 - a broken adapter check is a problem to report, not a crash
        refusals = [Problem("", f"the {p.engine} adapter could not check this profile: {e!r}")]
    problems = [Problem(_join(path, r.path), r.reason) for r in refusals]
    refused = {r.path for r in refusals}
    if p.nodes > 1 and p.gpu is None and "nodes" not in refused and "gpu" not in refused:
        problems.append(Problem(f"{path}.nodes", "a multi-node replica needs a gpu (nodes > 1 splits a model across GPUs)"))
    if adapter.needs_gpu and p.gpu is not None:
        total = p.tensor_parallel * p.pipeline_parallel
        if total % p.nodes:
            problems.append(Problem(
                f"{path}.nodes",
                f"tensor_parallel x pipeline_parallel = {total} GPUs cannot be split evenly over {p.nodes} nodes",
            ))
        elif p.gpu.count != total // p.nodes:
            problems.append(Problem(
                f"{path}.gpu.count",
                f"gpu.count is GPUs per node and must equal tensor_parallel x pipeline_parallel / nodes = "
                f"{p.tensor_parallel} x {p.pipeline_parallel} / {p.nodes} = {total // p.nodes} (got {p.gpu.count})",
            ))
    problems += _args_problems(p.args, f"{path}.args")
    for key in p.env:
        if key in _RESERVED_ENV:
            problems.append(Problem(f"{path}.env.{key}", f"'{key}' is set by llmgw: {_RESERVED_ENV[key]}"))
    return problems


# Fields the cross-field rules read: when one of them is itself invalid, those rules are skipped
# rather than reporting consequences of the first error.
_RULE_FIELDS = frozenset({"engine", "gpu", "tensor_parallel", "pipeline_parallel", "nodes"})


def _rules_despite(e: ValidationError, merged: dict, path: str) -> list[Problem]:
    """Cross-field problems of a profile that also has type errors, so all are reported at once."""
    bad = {err["loc"][0] for err in e.errors(include_url=False) if err["loc"]}
    if bad & _RULE_FIELDS:
        return []
    try:
        profile = Profile.model_validate({k: v for k, v in merged.items() if k not in bad})
    except ValidationError:
        return []
    out = []
    for p in _profile_problems(profile, path):
        field = p.path[len(path) + 1:].split(".")[0].split("[")[0]
        if field not in bad:
            out.append(p)
    return out


def _source_problems(source: Any, engine: str, path: str, profile_name: str = "") -> list[Problem]:
    """Whether `engine` can load `source`; `profile_name` is set when the source is the model's."""
    if not isinstance(source, str):
        return []  # already reported as a type error
    who = f"{engine} (profile {profile_name})" if profile_name else engine
    out = []
    pkg = _PKG_RE.match(source)
    if source.startswith("pkg:") and not pkg:
        out.append(Problem(path, f"{source!r} must be written pkg:<package>/<file>"))
    elif engine == "vllm" and pkg:  # an empty source is fine: vLLM loads the model's name from Hugging Face
        out.append(Problem(path, f"{who} loads a Hugging Face id or a directory, not pkg:<package>/<file>"))
    elif engine == "llamacpp" and not source:
        out.append(Problem(path, f"{who} needs a source: a .gguf file path or pkg:<package>/<file>"))
    elif engine == "llamacpp" and not source.lower().endswith(".gguf"):
        out.append(Problem(path, f"{who} loads a GGUF file: {source!r} must end in .gguf "
                                 "(a profile may set its own `source`)"))
    return out


def _name_problems(models: list[Any]) -> list[Problem]:
    """Model names unique; aliases unique across every name and alias of the catalog."""
    problems: list[Problem] = []
    owner: dict[str, str] = {}  # name -> path of the model it names
    for i, m in enumerate(models):
        name = m.get("name") if isinstance(m, dict) else None
        if isinstance(name, str) and name:
            if name in owner:
                problems.append(Problem(f"models[{i}].name", f"duplicate model name {name!r} (also {owner[name]})"))
            else:
                owner[name] = f"models[{i}]"
    alias_owner: dict[str, str] = {}
    for i, m in enumerate(models):
        if not isinstance(m, dict) or not isinstance(m.get("aliases"), list):
            continue
        own = m.get("name")
        for k, alias in enumerate(m["aliases"]):
            if not isinstance(alias, str) or not alias:
                continue
            path = f"models[{i}].aliases[{k}]"
            if alias == own:
                problems.append(Problem(path, f"alias {alias!r} is the model's own name"))
            elif alias in owner:
                problems.append(Problem(path, f"alias {alias!r} is the name of {owner[alias]}"))
            elif alias in alias_owner:
                other = alias_owner[alias]
                where = "listed twice" if other.startswith(f"models[{i}].") else f"also an alias at {other}"
                problems.append(Problem(path, f"alias {alias!r} is {where}"))
            else:
                alias_owner[alias] = path
    return problems


def parse_catalog(data: Any, source: str = "<catalog>") -> Catalog:
    """Validate a catalog document (as loaded from YAML) and resolve its defaults.

    Raises CatalogInvalid with every problem found, each with its field path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CatalogInvalid(source, [Problem("", f"the catalog must be a mapping with a `models` list, got {_describe(data)}")])
    problems: list[Problem] = []
    for key in data:
        if key not in _KNOWN_KEYS["catalog"]:
            close = difflib.get_close_matches(str(key), _KNOWN_KEYS["catalog"], n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else " (known: models, defaults)"
            problems.append(Problem(str(key), f"unknown field '{key}'{hint}"))
    defaults = _validate_defaults(data.get("defaults"), problems)
    raw_models = data.get("models", [])
    if raw_models is None:
        raw_models = []
    if not isinstance(raw_models, list):
        problems.append(Problem("models", f"must be a list, got {_describe(raw_models)}"))
        raw_models = []

    models: list[Model] = []
    for i, raw in enumerate(raw_models):
        mpath = f"models[{i}]"
        if not isinstance(raw, dict):
            problems.append(Problem(mpath, f"must be a mapping (name, source, profiles), got {_describe(raw)}"))
            continue
        header = None
        try:
            header = Model.model_validate({k: v for k, v in raw.items() if k != "profiles"})
        except ValidationError as e:
            problems += _pydantic_problems(e, mpath, "model")
        raw_profiles = raw.get("profiles", [])
        if not isinstance(raw_profiles, list):
            problems.append(Problem(f"{mpath}.profiles", f"must be a list, got {_describe(raw_profiles)}"))
            raw_profiles = []
        if not raw_profiles:
            problems.append(Problem(f"{mpath}.profiles", "a model needs at least one profile (use replicas: 0 to keep it idle)"))
        profiles: list[Profile] = []
        seen: dict[str, int] = {}
        for j, rawp in enumerate(raw_profiles):
            ppath = f"{mpath}.profiles[{j}]"
            if not isinstance(rawp, dict):
                problems.append(Problem(ppath, f"must be a mapping of profile fields, got {_describe(rawp)}"))
                continue
            pname = rawp.get("name")
            if isinstance(pname, str) and pname:
                if pname in seen:
                    problems.append(Problem(f"{ppath}.name", f"duplicate profile name {pname!r} (also profiles[{seen[pname]}])"))
                else:
                    seen[pname] = j
            merged = _merge_defaults(defaults, rawp)
            try:
                profile = Profile.model_validate(merged)
                problems += _profile_problems(profile, ppath)
                profiles.append(profile)
            except ValidationError as e:
                problems += _pydantic_problems(e, ppath, "profile")
                problems += _rules_despite(e, merged, ppath)
            engine = merged.get("engine")
            if isinstance(engine, str) and engine in ENGINE_NAMES:
                if merged.get("source") is not None:
                    problems += _source_problems(merged["source"], engine, f"{ppath}.source")
                else:
                    pname = rawp.get("name") if isinstance(rawp.get("name"), str) else f"#{j}"
                    problems += _source_problems(raw.get("source", ""), engine, f"{mpath}.source", pname)
        if header is not None and len(profiles) == len(raw_profiles):
            models.append(header.model_copy(update={"profiles": profiles}))
    problems += _name_problems(raw_models)
    if problems:
        raise CatalogInvalid(source, problems)
    return Catalog(models=models)


# --- reading a file ------------------------------------------------------------------------------


# libyaml's parser when PyYAML was built with it (about 10x faster), the pure-Python one otherwise;
# both keep node marks, which give each problem its line. Duplicate keys are found on the node tree.
_LineLoader = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def _line_map(node: yaml.Node, problems: list[Problem]) -> dict[str, int]:
    """Field path -> 1-based line, for pointing at the spot in the file; also finds duplicate keys."""
    lines: dict[str, int] = {}

    def walk(n: yaml.Node, path: str) -> None:
        lines.setdefault(path, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for k, v in n.value:
                key = str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
                child = _join(path, key)
                if key in seen:
                    problems.append(Problem(child, f"duplicate key '{key}' (line {k.start_mark.line + 1})"))
                seen.add(key)
                lines.setdefault(child, k.start_mark.line + 1)
                walk(v, child)
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, f"{path}[{i}]")

    walk(node, "")
    return lines


def _line_of(path: str, lines: dict[str, int]) -> int | None:
    """The line of `path`, or of its nearest ancestor present in the file (a missing field)."""
    while path:
        if path in lines:
            return lines[path]
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
    return None


def parse_catalog_text(text: str, source: str = "<catalog>") -> Catalog:
    """Parse YAML text; problems carry the line they point at, and duplicate keys are errors."""
    try:
        loader = _LineLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise CatalogInvalid(source, [Problem("", f"not valid YAML: {where}{what}")]) from e
    duplicates: list[Problem] = []  # these carry their own line already
    lines = _line_map(node, duplicates) if node is not None else {}
    try:
        catalog = parse_catalog(data, source)
    except CatalogInvalid as e:
        located = [(_line_of(p.path, lines), p) for p in e.problems]
        located = [(n, Problem(p.path, f"{p.reason} (line {n})") if n else p) for n, p in located]
        located += [(_line_of(p.path, lines), p) for p in duplicates]
        # In file order, so the list reads top to bottom like the file; problems without a line last.
        ordered = [p for _, p in sorted(located, key=lambda item: item[0] or 10**9)]
        raise CatalogInvalid(source, ordered) from None
    if duplicates:
        raise CatalogInvalid(source, duplicates)
    return catalog


def load_catalog_file(path: str | Path) -> Catalog:
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise CatalogInvalid(str(path), [Problem("", f"cannot read: {reason}")]) from e
    return parse_catalog_text(text, str(path))
