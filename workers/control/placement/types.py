"""What placement is asked and what it answers: a request, a placement, or why not."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

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
        """No selector and no exclusion: every schedulable node of the pool is eligible."""
        return not self.selector and not self.exclude

    @cached_property
    def key(self) -> tuple:
        """Requests with the same key get the same answer from the same view."""
        return (self.model, self.pool, self.selector, self.gpu_class, self.gpu_count, self.nodes, self.exclude)


@dataclass(frozen=True)
class Placement:
    nodes: tuple[str, ...]  # head first
    gpus: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (node, GPU indexes) per node; () for CPU

    @property
    def head(self) -> str:
        return self.nodes[0]

    def gpus_dict(self) -> dict[str, list[int]]:
        return {n: list(idx) for n, idx in self.gpus}


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
