"""Engine driver for engine `sim`: the simulated engine (`python -m simengine`), no GPU needed.

It reports vLLM's metric names by default; a profile with `--metrics-style llamacpp` in its args
reports llama.cpp's, and then its default mapping follows (see `effective_metrics`).

Multi-node replicas work as vLLM's do: every node runs the sim with `--nnodes/--node-rank/--master-addr/
--master-port`; the head (rank 0) serves HTTP and is healthy once all members joined its rendezvous,
the others are `--headless` (see simengine/multinode.py).

A profile with `lora:` serves LoRA adapters as vLLM does (simengine/lora.py): the same flags, the
runtime load and unload calls and their answers; a profile's args may add `--lora-load-time`.

Like vLLM it starts with `--scheduling-policy priority` and its requests carry the gateway's rank as
`priority` and a key's `cache_salt` (`order_fields`, vLLM's); one styled as llama.cpp ignores both.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from llmgw.catalog.types import MetricMapping, Profile
from llmgw import surface as op
from llmgw.engines.base import AdapterCall, AdapterOutcome, EngineDriver, LaunchContext, LaunchSpec
from llmgw.engines.llamacpp import LLAMACPP_METRICS, LlamaCppDriver
from llmgw.engines.vllm import (
    SCHEDULING_FLAG,
    SCHEDULING_POLICY,
    VLLM_KV_FALLBACKS,
    VLLM_LORA_RANKS,
    VLLM_METRICS,
    VllmDriver,
    runtime_lora_launch,
    runtime_lora_problems,
    scheduling_problems,
    vllm_adapter_outcome,
    vllm_load_call,
    vllm_order_fields,
    vllm_unload_call,
)
from llmgw.errors import Problem
from simengine.cli import check_args


def _metrics_style(args: list[str]) -> str:
    style = "vllm"
    for i, a in enumerate(args):
        if a == "--metrics-style" and i + 1 < len(args):
            style = args[i + 1]
        elif a.startswith("--metrics-style="):
            style = a.split("=", 1)[1]
    return style


# What simengine/server.py serves (no embeddings); its paths are vLLM's.
SIM_PATHS = {
    **op.same_paths(op.CHAT, op.COMPLETIONS, op.RESPONSES, op.RESPONSES_GET, op.RESPONSES_DELETE, op.RERANK,
                    op.SCORE, op.TRANSCRIPTIONS),
    op.TOKENIZE: "/tokenize",
    op.DETOKENIZE: "/detokenize",
}

# The KV block of vLLM's CPU build (its cache_config_info says block_size="128"; GPUs: 16).
CPU_BLOCK_SIZE = 128

# Flags the driver sets for multi-node replicas (the catalog already reserves --nnodes, --node-rank
# and --master-addr for every engine).
_MULTI_NODE_FLAGS = ("--master-port", "--headless")


class SimDriver(EngineDriver):
    name = "sim"
    needs_gpu = False
    supports_tensor_parallel = True
    supports_multi_node = True
    default_metrics = VLLM_METRICS
    kv_fallbacks = VLLM_KV_FALLBACKS
    prompt_tokens_metric = VllmDriver.prompt_tokens_metric
    generation_tokens_metric = VllmDriver.generation_tokens_metric
    prefix_queries_metric = VllmDriver.prefix_queries_metric
    prefix_hits_metric = VllmDriver.prefix_hits_metric
    prefill_seconds_metric = VllmDriver.prefill_seconds_metric
    prefill_tokens_metric = VllmDriver.prefill_tokens_metric
    kv_config_metric = VllmDriver.kv_config_metric
    credential_env = "SIMENGINE_API_KEY"  # guards /v1, like vLLM
    # LoRA as vLLM serves it: loaded and unloaded at run time, with vLLM's calls, answers and flags.
    supports_lora = True
    continues_answers = True  # continue_final_message with add_generation_prompt: false
    supports_kv_events = True
    lora_ranks = VLLM_LORA_RANKS
    lora_flags = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras")
    order_defaults = VllmDriver.order_defaults

    def order_fields(self, rank: int, cache_salt: str | None) -> dict:
        return vllm_order_fields(rank, cache_salt)

    def lora_refusals(self, profile: Profile) -> list[Problem]:
        return super().lora_refusals(profile) + runtime_lora_problems(profile)

    def adapter_load_call(self, name: str, path: str) -> AdapterCall | None:
        return vllm_load_call(name, path)

    def adapter_unload_call(self, name: str) -> AdapterCall | None:
        return vllm_unload_call(name)

    def adapter_outcome(self, call: AdapterCall, status: int, text: str) -> AdapterOutcome:
        return vllm_adapter_outcome(call, status, text)

    def refusals(self, profile: Profile) -> list[Problem]:
        problems = (super().refusals(profile) + [Problem("args", reason) for reason in check_args(profile.args)]
                    + scheduling_problems(profile))
        for flag in _MULTI_NODE_FLAGS:
            if any(a == flag or a.startswith(flag + "=") for a in profile.args):
                problems.append(Problem("args", f"'{flag}' is set by llmgw for multi-node replicas"))
        return problems

    def paths(self, profile: Profile) -> dict[str, str]:
        return dict(SIM_PATHS)

    def weights_layout(self, source: str) -> str | None:
        """The sim loads nothing, but a remote source is downloaded as the engine it stands in for
        would: one GGUF file when the source names one, else a repository snapshot."""
        return "llamacpp" if source.split("#")[0].lower().endswith(".gguf") else "vllm"

    def effective_metrics(self, profile: Profile) -> MetricMapping:
        if _metrics_style(profile.args) == "llamacpp" and (profile.metrics is None or profile.metrics.is_empty()):
            return LLAMACPP_METRICS
        return super().effective_metrics(profile)

    def token_metrics(self, profile: Profile) -> tuple[str | None, str | None]:
        if _metrics_style(profile.args) == "llamacpp":
            return LlamaCppDriver.prompt_tokens_metric, LlamaCppDriver.generation_tokens_metric
        return super().token_metrics(profile)

    def cache_metrics(self, profile: Profile) -> tuple[str | None, str | None, str | None, str | None]:
        if _metrics_style(profile.args) == "llamacpp":
            return None, None, LlamaCppDriver.prefill_seconds_metric, None
        return super().cache_metrics(profile)

    def tokenize_prompt(self, operation: str, body: Mapping) -> list[int] | None:
        # The simulated engine's own tokenizer and chat template (simengine.tokens): exact.
        from simengine import tokens

        if operation == op.CHAT and isinstance(body.get("messages"), list):
            return tokens.chat_tokens(body["messages"])
        if operation == op.COMPLETIONS:
            return tokens.prompt_tokens(body.get("prompt"))
        return None

    def command(self, ctx: LaunchContext) -> LaunchSpec:
        p = ctx.profile
        argv = [sys.executable, "-m", "simengine", "--host", ctx.host, "--port", str(ctx.port),
                "--served-model-name", *ctx.model.names]
        # capacity means "sequences at once", which is --max-seqs here (explicit args win).
        if p.capacity is not None and not any(a == "--max-seqs" or a.startswith("--max-seqs=") for a in p.args):
            argv += ["--max-seqs", str(p.capacity)]
        # `device: cpu`: the sim stands in for vLLM's CPU build, whose KV blocks are 128 tokens, not 16.
        if p.device == "cpu" and not any(a == "--block-size" or a.startswith("--block-size=") for a in p.args):
            argv += ["--block-size", str(CPU_BLOCK_SIZE)]
        argv += [SCHEDULING_FLAG, SCHEDULING_POLICY]
        multi, headless = self.multi_node_args(ctx)
        argv += multi
        lora_argv, lora_env = runtime_lora_launch(p)
        argv += lora_argv
        argv += self.kv_events_args(ctx)
        argv += p.args
        return LaunchSpec(argv=tuple(argv), env={**self.engine_env(ctx, p), **lora_env}, serves_http=not headless,
                          health_path="/health", start_timeout=p.start_timeout)
