"""Engine drivers, by catalog `engine` name."""

from __future__ import annotations

from llmgw.engines.base import EngineDriver, LaunchContext, LaunchSpec
from llmgw.engines.external import ExternalDriver
from llmgw.engines.llamacpp import LlamaCppDriver
from llmgw.engines.sim import SimDriver
from llmgw.engines.vllm import VllmDriver

_RUN: dict[str, EngineDriver] = {a.name: a for a in (VllmDriver(), LlamaCppDriver(), SimDriver())}
ENGINES: dict[str, EngineDriver] = {**_RUN, "external": ExternalDriver(_RUN)}


def get_engine(name: str) -> EngineDriver:
    return ENGINES[name]


__all__ = ["ENGINES", "EngineDriver", "LaunchContext", "LaunchSpec", "get_engine"]


def tokenize_prompt(engine: str, operation: str, body) -> list[int] | None:
    """The tokens engine `engine` makes of a request's prompt (precise prefix routing); None: unknown."""
    driver = ENGINES.get(engine)
    return driver.tokenize_prompt(operation, body) if driver is not None else None
