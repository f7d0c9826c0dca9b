"""What placement is asked and what it answers: a request, a placement, or why not."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, NamedTuple

from llmgw.gpus import normalize_gpu_class


@dataclass(frozen=True)
class PlacementRequest:
    """What one replica of a profile needs. `exclude`: nodes it must avoid (a crash-looping home)."""

    model: str
    profile: str
    pool: str = "default"
    selector: tuple[tuple[str, str], ...] = ()
    gpu_class: str | None = None  # normalised; None = CPU
    gpu_count: int = 0
    nodes: int = 1
    exclude: frozenset[str] = frozenset()
    # Weights (docs/weights.md): `hold` places nothing yet and says why (a remote source's headers are
    # not read yet); `weights` is the remote source, preferred where a node holds it; `weights_size` the
    # bytes a node without it must have room for; `too_small`: device memories (MiB: one GPU of the
    # class, or a CPU node's memory) the profile does not fit, each with the fit estimate's message.
    hold: str | None = None
    weights: str | None = None
    weights_size: int = 0
    too_small: tuple[tuple[int, str], ...] = ()

    @classmethod
    def for_profile(cls, model: str, profile, exclude: Iterable[str] = ()) -> "PlacementRequest":
        """Build the request from a catalog `Profile`."""
        gpu = profile.gpu
        return cls(
            model=model,
            profile=profile.name,
            pool=profile.pool,
            selector=tuple(sorted(profile.node_selector.items())),
            gpu_class=normalize_gpu_class(gpu.gpu_class) if gpu else None,
            gpu_count=gpu.count if gpu else 0,
            nodes=profile.nodes,
            exclude=frozenset(exclude),
        )

    @property
    def plain(self) -> bool:
        """No selector, no exclusion, no disk or fit check: every schedulable node of the pool is eligible."""
        return not self.selector and not self.exclude and not self.weights_size and not self.too_small

    @cached_property
    def key(self) -> tuple:
        """Requests with the same key get the same answer from the same view."""
        return (self.model, self.pool, self.selector, self.gpu_class, self.gpu_count, self.nodes, self.exclude,
                self.hold, self.weights, self.weights_size, self.too_small)


@dataclass(frozen=True)
class Placement:
    nodes: tuple[str, ...]  # head first
    gpus: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (node, GPU indexes) per node; () for CPU

    @property
    def head(self) -> str:
        return self.nodes[0]

    def gpus_dict(self) -> dict[str, list[int]]:
        return {n: list(idx) for n, idx in self.gpus}


class WeightsRefusal(NamedTuple):
    """Why one node cannot take a request's weights: `kind` "fit" (no device of it holds the model)
    or "disk" (no room for the files), and `why` in words."""

    kind: str
    why: str


@dataclass(frozen=True)
class Refusal:
    """Why some nodes could not take a replica: `count` nodes, the first few named (sorted)."""

    why: str
    nodes: tuple[str, ...]
    count: int

    def to_dict(self) -> dict:
        return {"why": self.why, "nodes": list(self.nodes), "count": self.count}


@dataclass(frozen=True)
class NoPlacement:
    reason: str
    # Every live node, grouped by why it was refused (most nodes first); computed only when placement
    # fails, once per distinct request per pass.
    refusals: tuple[Refusal, ...] = ()
