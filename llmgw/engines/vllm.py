"""Adapter for engine `vllm`: `vllm serve` (V1 engine), one process per replica per node.

GPUs are pinned with CUDA_VISIBLE_DEVICES. A multi-node replica runs without Ray: every node runs
`vllm serve` with `--nnodes/--node-rank/--master-addr/--master-port`; only the head (rank 0) serves HTTP, the
others are `--headless`. /health answers only after the (long) model load: the catalog gives vLLM
profiles a 900 s start timeout by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from llmgw.catalog.types import MetricMapping, Profile
from llmgw.engines.base import PKG_SOURCE, EngineAdapter, LaunchContext, LaunchSpec
from llmgw.errors import Problem

VLLM_METRICS = MetricMapping(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
)
# Before 0.9.2 the KV gauge was vllm:gpu_cache_usage_perc (removed in 0.12).
VLLM_KV_FALLBACKS = ("vllm:gpu_cache_usage_perc",)


class VllmAdapter(EngineAdapter):
    name = "vllm"
    needs_gpu = True
    supports_tensor_parallel = True
    supports_multi_node = True
    default_metrics = VLLM_METRICS
    kv_fallbacks = VLLM_KV_FALLBACKS
    prompt_tokens_metric = "vllm:prompt_tokens_total"
    generation_tokens_metric = "vllm:generation_tokens_total"

    def __init__(self, environ: Mapping[str, str] | None = None):
        # LLMGW_VLLM names the executable (e.g. a venv's bin/vllm); default `vllm` from PATH.
        self._environ = os.environ if environ is None else environ

    def refusals(self, profile: Profile) -> list[Problem]:
        """Besides the base rules: tensor x pipeline parallelism spans `nodes` nodes evenly, and
        `gpu.count` is the GPUs of one node."""
        problems = super().refusals(profile)
        if profile.gpu is not None:
            total = profile.tensor_parallel * profile.pipeline_parallel
            if total % profile.nodes:
                problems.append(Problem(
                    "nodes",
                    f"tensor_parallel x pipeline_parallel = {total} GPUs cannot be split evenly over {profile.nodes} nodes",
                ))
            elif profile.gpu.count != total // profile.nodes:
                problems.append(Problem(
                    "gpu.count",
                    f"gpu.count is GPUs per node and must equal tensor_parallel x pipeline_parallel / nodes = "
                    f"{profile.tensor_parallel} x {profile.pipeline_parallel} / {profile.nodes} = "
                    f"{total // profile.nodes} (got {profile.gpu.count})",
                ))
        return problems

    def source_refusal(self, source: str, who: str) -> str | None:
        # An empty source is fine: vLLM loads the model's name from Hugging Face.
        if PKG_SOURCE.match(source):
            return f"{who} loads a Hugging Face id or a directory, not pkg:<package>/<file>"
        return None

    def command(self, ctx: LaunchContext) -> LaunchSpec:
        p = ctx.profile
        source = ctx.model.source or ctx.model.name
        argv = [self._environ.get("LLMGW_VLLM") or "vllm", "serve", source,
                "--host", ctx.host, "--port", str(ctx.port),
                "--served-model-name", *ctx.model.names,
                "--tensor-parallel-size", str(p.tensor_parallel)]
        if p.pipeline_parallel > 1:
            argv += ["--pipeline-parallel-size", str(p.pipeline_parallel)]
        multi, headless = self.multi_node_args(ctx)
        argv += multi
        argv += p.args
        return LaunchSpec(argv=tuple(argv), env=self.gpu_env(ctx, p), serves_http=not headless, health_path="/health",
                          start_timeout=p.start_timeout)
