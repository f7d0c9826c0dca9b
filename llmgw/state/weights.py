"""The records of model weights kept in Redis beside the fleet's (`llmgw.state.records`): what a node
agent read of a remote source for placement, and how a `llmgw models pull` goes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmgw.state.records import from_known


@dataclass(frozen=True)
class WeightsFacts:
    """What a node agent read of a remote source before any replica downloads it: the bytes it takes
    on disk and the model's shape (`llmgw.weights.meta.Shape` as a dict), which placement checks
    against each node's free disk and GPU memory; or why they could not be read (`error`)."""

    source: str
    layout: str = ""  # llamacpp (one GGUF) | vllm (a repository)
    size: int | None = None
    shape: dict[str, Any] | None = None
    error: str | None = None
    read_at: float = 0.0
    node: str = ""  # whose agent read it

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WeightsFacts":
        return from_known(cls, d)


@dataclass(frozen=True)
class PullStatus:
    """How one `llmgw models pull` of a source on one node is going, as its agent last wrote it."""

    source: str
    phase: str  # queued | resolving | waiting | downloading | verifying | complete | failed
    done: int = 0
    total: int | None = None
    rate: float | None = None
    eta: float | None = None
    error: str | None = None
    error_kind: str | None = None
    at: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PullStatus":
        return from_known(cls, d)
