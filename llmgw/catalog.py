"""The catalog: what operators write (YAML), parsed and validated into frozen types.

This is the contract every part reads. `parse_catalog(data, source)` returns a `Catalog` or raises
`CatalogInvalid` listing every problem with its field path. (Draft: the full rule set of issue 3 is
filled in by the catalog work; the type names and fields here are the stable API.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmgw.errors import CatalogInvalid, Problem

EngineName = Literal["vllm", "llamacpp", "sim"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class GPURequest(_Strict):
    gpu_class: str = Field(alias="class", min_length=1)
    count: int = Field(default=1, ge=1)


class MetricMapping(_Strict):
    """Names of the three series the router needs. None/blank = not reported (unknown)."""

    running: str | None = None
    waiting: str | None = None
    kv_usage: str | None = None

    def is_empty(self) -> bool:
        return not (self.running or self.waiting or self.kv_usage)


class Profile(_Strict):
    name: str = Field(min_length=1)
    engine: EngineName
    replicas: int = Field(default=1, ge=0)
    gpu: GPURequest | None = None  # None: runs on the CPU
    tensor_parallel: int = Field(default=1, ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    nodes: int = Field(default=1, ge=1)
    priority: int = 0
    weight: float = Field(default=1.0, gt=0)
    pool: str = "default"
    node_selector: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    capacity: int | None = Field(default=None, ge=1)
    metrics: MetricMapping | None = None
    start_timeout: float = Field(default=120.0, gt=0)


class Model(_Strict):
    name: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    source: str = ""
    profiles: list[Profile] = Field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)


class Catalog(_Strict):
    models: list[Model] = Field(default_factory=list)

    def model(self, name: str) -> Model | None:
        return next((m for m in self.models if m.name == name), None)

    def resolve(self, name_or_alias: str) -> Model | None:
        return next((m for m in self.models if name_or_alias in m.names), None)

    def canonical(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    def hash(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def profile_spec_hash(model: Model, profile: Profile) -> str:
    """Hash of everything that requires a new process when it changes (not replicas/priority/weight)."""
    spec = profile.model_dump(mode="json", by_alias=True, exclude={"replicas", "priority", "weight"})
    spec["_model"] = {"name": model.name, "aliases": model.aliases, "source": model.source}
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_catalog(data: Any, source: str = "<catalog>") -> Catalog:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CatalogInvalid(source, [Problem("", "the catalog must be a mapping with a `models` list")])
    try:
        return Catalog.model_validate(data)
    except ValidationError as e:
        problems = [Problem(_loc_to_path(err["loc"]), err["msg"]) for err in e.errors()]
        raise CatalogInvalid(source, problems) from e


def load_catalog_file(path: str | Path) -> Catalog:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CatalogInvalid(str(path), [Problem("", f"cannot read: {e.strerror}")]) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CatalogInvalid(str(path), [Problem("", f"not valid YAML: {e}")]) from e
    return parse_catalog(data, str(path))
