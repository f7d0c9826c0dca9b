"""Whether a profile fits its GPU (or a CPU node's memory), from the weights' shape: pure arithmetic.

    estimate(shape, workload) -> Estimate        per device: weights + KV cache + overhead
    fits(estimate, device) -> Fit | DoesNotFit   "needs ~18.3 GiB per GPU at tensor_parallel 1; an L4
                                                  has 24 GiB, of which 20.1 free"
    advise(shape, workload, device)              the same, and what would fit (a larger
                                                  tensor_parallel, a shorter context)

KV cache per token = sum over layers of kv_heads x (key + value head size) x bytes per element.

llama.cpp allocates its whole KV cache at start: `-c` tokens in total across its slots (f16 unless
`-ctk/-ctv`), plus a compute buffer for a 512-token micro-batch and the logits of its slots; SmolLM2
with -c 8192 -np 4 measured here: model 92.1 MiB, KV 180.0 MiB, compute 16.6 MiB, as this predicts.
On a GPU it offloads every layer (-ngl 999), split over the profile's `gpu.count` cards.

vLLM takes `gpu_memory_utilization` (0.9) of each card at start and refuses to start when less is
free; inside it, weights / (tensor_parallel x pipeline_parallel), activations of one
`max_num_batched_tokens` step and the sampler's logits of `max_num_seqs` sequences, CUDA graphs and
the CUDA context, and the KV cache gets what is left. It refuses to start unless that holds one
sequence of `max_model_len` tokens, so that is what "fits" means here; the worst case
(`max_model_len` x `max_num_seqs`) is reported as how many full-length sequences the cache holds.
KV heads are split over tensor-parallel ranks (replicated when there are fewer heads than ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from llmgw.gpus import gpu_memory_mb
from llmgw.weights.meta import Shape

GIB = 1024 ** 3
MIB = 1024 ** 2
# Bytes per element of a KV cache type (llama.cpp's -ctk/-ctv names, vLLM's --kv-cache-dtype).
KV_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "auto": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                 "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
VLLM_BASE_OVERHEAD = 1.5 * GIB  # CUDA context, non-torch allocations, CUDA graphs
LLAMACPP_GPU_CONTEXT = 0.4 * GIB  # the CUDA context of one card
LLAMACPP_UBATCH = 512


@dataclass(frozen=True)
class Workload:
    """What a profile asks of its engine: the engine drivers fill this from the profile's args."""

    engine: str  # vllm | llamacpp
    context: int  # llama.cpp: -c (all slots); vLLM: max_model_len
    sequences: int = 1  # llama.cpp: -np; vLLM: max_num_seqs
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    devices: int = 1  # llama.cpp: the GPUs one replica spreads over (gpu.count); 0: the CPU
    kv_bytes: float | None = None  # per element; None: f16 (llama.cpp) or the weights' dtype (vLLM)
    gpu_memory_utilization: float = 0.9
    max_batched_tokens: int = 2048


@dataclass(frozen=True)
class Estimate:
    """Bytes one device needs (a GPU, or a CPU node's memory): the parts and their sum."""

    engine: str
    weights: int
    kv: int  # the KV cache the engine must have to start
    overhead: int
    kv_per_sequence: int  # one full-length sequence's KV on this device
    context: int
    sequences: int
    tensor_parallel: int = 1
    on_gpu: bool = True

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead

    def describe(self) -> str:
        where = f"per GPU at tensor_parallel {self.tensor_parallel}" if self.on_gpu else "of memory"
        return f"~{_gib(self.total)} GiB {where} (weights {_gib(self.weights)}, KV cache {_gib(self.kv)}, " \
               f"overhead {_gib(self.overhead)})"


@dataclass(frozen=True)
class Device:
    """One GPU of a class, or a CPU node's memory: `label` reads "an L4" / "this node"."""

    label: str
    memory: int
    free: int | None = None
    gpu: bool = True


@dataclass(frozen=True)
class Fit:
    estimate: Estimate
    device: Device
    headroom: int  # bytes left of what the engine may take
    sequences_at_full_length: int | None = None  # vLLM: how many max_model_len sequences the KV holds

    ok = True


@dataclass(frozen=True)
class DoesNotFit:
    estimate: Estimate
    device: Device
    message: str

    ok = False


def gpu_device(gpu_class: str, memory_mb: int = 0, free_mb: int | None = None) -> Device:
    """One GPU of `gpu_class`: its reported memory when known, else the class's nominal memory."""
    memory = gpu_memory_mb(gpu_class, memory_mb) * MIB
    return Device(label=f"{_article(gpu_class)} {gpu_class.upper()}", memory=memory,
                  free=free_mb * MIB if free_mb is not None else None)


def cpu_device(memory_mb: int, free_mb: int | None = None) -> Device:
    return Device(label="this node", memory=memory_mb * MIB, free=free_mb * MIB if free_mb is not None else None,
                  gpu=False)


def _article(cls: str) -> str:
    """A class with a digit is read letter by letter (an A100, an H100, an L4, an RTX4090, a T4);
    a word is read as a word (a fake)."""
    vowels = "aefhilmnorsx" if any(c.isdigit() for c in cls) else "aeiou"
    return "an" if cls[:1].lower() in vowels else "a"


def estimate(shape: Shape, w: Workload) -> Estimate:
    if w.engine == "vllm":
        return _vllm(shape, w)
    return _llamacpp(shape, w)


def _kv_per_token(shape: Shape, kv_bytes: float, tp: int = 1, pp: int = 1) -> float:
    if tp <= 1 and pp <= 1:
        return shape.kv_elems_per_token * kv_bytes
    heads_per_rank = max(1, math.ceil(shape.kv_heads / tp)) if shape.kv_heads else 0
    ratio = heads_per_rank / shape.kv_heads if shape.kv_heads else 1
    return shape.kv_elems_per_token * ratio / pp * kv_bytes


def _vllm(shape: Shape, w: Workload) -> Estimate:
    tp, pp = w.tensor_parallel, w.pipeline_parallel
    kv_bytes = w.kv_bytes if w.kv_bytes is not None else shape.dtype_bytes
    per_seq = int(_kv_per_token(shape, kv_bytes, tp, pp) * w.context)
    logits = w.sequences * shape.vocab * 4 * 2  # the sampler's float32 logits and probabilities
    activations = w.max_batched_tokens * (shape.hidden + shape.ff // tp) * 2 * 2
    return Estimate("vllm", weights=int(shape.weights_bytes / (tp * pp)), kv=per_seq,
                    overhead=int(VLLM_BASE_OVERHEAD + logits + activations), kv_per_sequence=per_seq,
                    context=w.context, sequences=w.sequences, tensor_parallel=tp, on_gpu=True)


def _llamacpp(shape: Shape, w: Workload) -> Estimate:
    n = max(w.devices, 1)
    kv_bytes = w.kv_bytes if w.kv_bytes is not None else KV_TYPE_BYTES["f16"]
    kv = int(shape.kv_elems_per_token * kv_bytes * w.context)
    compute = LLAMACPP_UBATCH * max(shape.ff, shape.hidden) * 4 * 6 + w.sequences * shape.vocab * 4
    overhead = compute + (LLAMACPP_GPU_CONTEXT if w.devices else 0)
    per_seq = int(shape.kv_elems_per_token * kv_bytes * (w.context // max(w.sequences, 1)))
    return Estimate("llamacpp", weights=shape.weights_bytes // n, kv=kv // n, overhead=int(overhead),
                    kv_per_sequence=per_seq // n, context=w.context, sequences=w.sequences, tensor_parallel=1,
                    on_gpu=w.devices > 0)


def fits(est: Estimate, device: Device, utilization: float = 0.9) -> Fit | DoesNotFit:
    """Whether `est` fits `device`. For vLLM the budget is `utilization` of the card, and that much
    must be free; llama.cpp may use all of what is free."""
    usable = int(device.memory * utilization) if est.engine == "vllm" and device.gpu else device.memory
    if device.free is not None:
        usable = min(usable, device.free) if not (est.engine == "vllm" and device.gpu) else usable
    need = est.total
    what = f"needs ~{_gib(need)} GiB per GPU at tensor_parallel {est.tensor_parallel}" if device.gpu else \
        f"needs ~{_gib(need)} GiB of memory"
    has = f"{device.label} has {_gib(device.memory, whole=True)} GiB"
    if device.free is not None:
        has += f", of which {_gib(device.free)} free"
    if device.memory <= 0:
        return DoesNotFit(est, device, f"{what}; the memory of {device.label} is not known")
    if need > usable:
        detail = f" (vLLM takes {utilization:g} of it)" if est.engine == "vllm" and device.gpu else ""
        return DoesNotFit(est, device, f"{what}; {has}{detail}")
    if est.engine == "vllm" and device.gpu and device.free is not None and device.free < usable:
        return DoesNotFit(est, device, f"{what}; {has}, and vLLM needs {utilization:g} of it free at start "
                                       f"({_gib(usable)} GiB)")
    full = None
    if est.engine == "vllm" and est.kv_per_sequence:
        full = (usable - est.weights - est.overhead) // est.kv_per_sequence
    return Fit(est, device, usable - need, full)


def advise(shape: Shape, w: Workload, device: Device) -> Fit | DoesNotFit:
    """`fits`, and when it does not, what would: vLLM's --gpu-memory-utilization when only the free
    memory is short, the smallest tensor_parallel (vLLM, up to 8), or the longest halved context."""
    result = fits(estimate(shape, w), device, w.gpu_memory_utilization)
    if result.ok:
        return result
    hints = []
    if w.engine == "vllm" and device.gpu and device.free is not None and device.memory:
        util = math.floor(device.free / device.memory * 100) / 100
        if util < w.gpu_memory_utilization and fits(estimate(shape, w), replace(device, free=None), util).ok:
            return replace(result, message=f"{result.message}; --gpu-memory-utilization {util:g} would fit")
    if w.engine == "vllm":
        for tp in (2, 4, 8):
            if tp > w.tensor_parallel and fits(estimate(shape, replace(w, tensor_parallel=tp)), device,
                                                w.gpu_memory_utilization).ok:
                hints.append(f"tensor_parallel {tp} would need ~{_gib(estimate(shape, replace(w, tensor_parallel=tp)).total)} GiB per GPU")
                break
    ctx = w.context // 2
    while ctx >= 256:
        if fits(estimate(shape, replace(w, context=ctx)), device, w.gpu_memory_utilization).ok:
            hints.append(f"{'max_model_len' if w.engine == 'vllm' else '-c'} {ctx} would fit")
            break
        ctx //= 2
    if not hints:
        hints.append("no tensor_parallel up to 8 or shorter context fits" if w.engine == "vllm"
                     else "not even a 256-token context fits")
    return replace(result, message=f"{result.message}; {', or '.join(hints)}")


def _gib(n: float, whole: bool = False) -> str:
    v = n / GIB
    return f"{v:.0f}" if whole and abs(v - round(v)) < 0.05 else f"{v:.1f}"
