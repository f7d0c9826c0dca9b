"""Adapter for engine `llamacpp` (stub: the command line is filled in by the engines work)."""

from __future__ import annotations

from llmgw.catalog import MetricMapping
from llmgw.engines.base import EngineAdapter, LaunchContext, LaunchSpec


class LlamaCppAdapter(EngineAdapter):
    name = "llamacpp"
    needs_gpu = False
    supports_tensor_parallel = False
    supports_multi_node = False
    default_metrics = MetricMapping(running="", waiting="", kv_usage="")

    def command(self, ctx: LaunchContext) -> LaunchSpec:
        raise NotImplementedError
