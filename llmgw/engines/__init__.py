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
