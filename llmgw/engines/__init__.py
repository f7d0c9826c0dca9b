"""Engine adapters, by catalog `engine` name."""

from __future__ import annotations

from llmgw.engines.base import EngineAdapter, LaunchContext, LaunchSpec
from llmgw.engines.external import ExternalAdapter
from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.sim import SimAdapter
from llmgw.engines.vllm import VllmAdapter

_RUN: dict[str, EngineAdapter] = {a.name: a for a in (VllmAdapter(), LlamaCppAdapter(), SimAdapter())}
ENGINES: dict[str, EngineAdapter] = {**_RUN, "external": ExternalAdapter(_RUN)}


def get_engine(name: str) -> EngineAdapter:
    return ENGINES[name]


__all__ = ["ENGINES", "EngineAdapter", "LaunchContext", "LaunchSpec", "get_engine"]


def tokenize_prompt(engine: str, operation: str, body) -> list[int] | None:
    """The tokens engine `engine` makes of a request's prompt (precise prefix routing); None: unknown."""
    adapter = ENGINES.get(engine)
    return adapter.tokenize_prompt(operation, body) if adapter is not None else None
