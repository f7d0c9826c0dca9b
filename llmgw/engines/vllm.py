"""Adapter for engine `vllm` (stub: the command line is filled in by the engines work)."""

from __future__ import annotations

from llmgw.catalog import MetricMapping
from llmgw.engines.base import EngineAdapter, LaunchContext, LaunchSpec


class VllmAdapter(EngineAdapter):
    name = "vllm"
    needs_gpu = True
    supports_tensor_parallel = True
    supports_multi_node = True
    default_metrics = MetricMapping(running="", waiting="", kv_usage="")

    def command(self, ctx: LaunchContext) -> LaunchSpec:
        raise NotImplementedError
