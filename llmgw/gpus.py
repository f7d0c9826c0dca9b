"""GPU class names and fleet descriptions.

`normalize_gpu_class("NVIDIA H100 80GB HBM3") == "h100"`: the catalog's `gpu.class` and a node's
discovered GPUs are compared after normalisation, so operators may write either the short class or the
name `nvidia-smi` prints.

How a name is normalised (first match wins):

1. An exact (case-insensitive) entry of the override map, `LLMGW_GPU_CLASS_MAP="NVIDIA Foo=foo,Bar X=bar"`.
2. Vendor words and memory sizes are dropped and the rest is matched against the table below
   (`NVIDIA A100-SXM4-80GB` -> `a100`, `Tesla T4` -> `t4`, `NVIDIA GeForce RTX 4090` -> `rtx4090`).
3. Otherwise: lower case, vendor words dropped, spaces and dashes removed (`NVIDIA Foo Bar` -> `foobar`).

| class     | matches (after dropping NVIDIA/Tesla/GeForce/Quadro and sizes) |
|-----------|-----------------------------------------------------------------|
| b200      | B200                                                            |
| h200      | H200                                                            |
| h100      | H100 (PCIe, SXM5, NVL, HBM3)                                    |
| h20       | H20                                                             |
| gh200     | GH200                                                           |
| a100      | A100 (40GB and 80GB, PCIe and SXM4)                             |
| a10g      | A10G                                                            |
| a10       | A10                                                             |
| a30 / a40 | A30 / A40                                                       |
| l40s      | L40S                                                            |
| l40 / l4  | L40 / L4                                                        |
| t4        | T4                                                              |
| v100      | V100                                                            |
| rtx6000ada| RTX 6000 Ada                                                    |
| a6000     | RTX A6000                                                       |
| rtx4090 / rtx3090 / ... | GeForce RTX 4090 / RTX 3090 / ...                 |
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Mapping

from llmgw.errors import ConfigError
from llmgw.state.node_records import GPUDevice

# Words that carry no class information.
_NOISE = re.compile(
    r"\b(nvidia|tesla|geforce|quadro|amd|radeon|instinct|pcie|sxm\d?|nvl|hbm\d?e?|\d+\s*gb|gpu)\b",
    re.IGNORECASE,
)
# (regex over the cleaned, lower-case name, class). Order matters: longer names first.
_TABLE: tuple[tuple[str, str], ...] = (
    (r"\bgh200\b", "gh200"),
    (r"\bgb200\b", "gb200"),
    (r"\bb200\b", "b200"),
    (r"\bb100\b", "b100"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b", "h100"),
    (r"\bh800\b", "h800"),
    (r"\bh20\b", "h20"),
    (r"\ba100\b", "a100"),
    (r"\ba800\b", "a800"),
    (r"\ba10g\b", "a10g"),
    (r"\ba10\b", "a10"),
    (r"\ba30\b", "a30"),
    (r"\ba40\b", "a40"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\bt4\b", "t4"),
    (r"\bv100\b", "v100"),
    (r"\bp100\b", "p100"),
    (r"\brtx\s*6000\s*ada\b", "rtx6000ada"),
    (r"\brtx\s*a6000\b", "a6000"),
    (r"\brtx\s*a5000\b", "a5000"),
    (r"\brtx\s*a4000\b", "a4000"),
    (r"\bmi300x\b", "mi300x"),
    (r"\bmi250x?\b", "mi250"),
    (r"\brtx\s*(\d{4})\s*(ti|super)?\b", "rtx{0}{1}"),
)


def parse_class_map(text: str) -> dict[str, str]:
    """`"NVIDIA Foo=foo,Bar X=bar"` -> {"nvidia foo": "foo", "bar x": "bar"} (keys lower-cased)."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, cls = item.partition("=")
        if not sep or not name.strip() or not cls.strip():
            raise ConfigError("LLMGW_GPU_CLASS_MAP", f"expected 'GPU name=class', got {item!r}")
        out[name.strip().lower()] = cls.strip().lower()
    return out


@lru_cache(maxsize=8)
def _class_map_from(text: str) -> dict[str, str]:
    return parse_class_map(text) if text else {}


def normalize_gpu_class(name: str, overrides: Mapping[str, str] | None = None) -> str:
    """The short class of a GPU name or class (`"NVIDIA H100 80GB HBM3"` -> `"h100"`).

    `overrides` defaults to LLMGW_GPU_CLASS_MAP; placement calls this in its inner loop, so the
    table lookup is cached."""
    raw = " ".join(name.strip().split())
    if overrides is None:
        overrides = _class_map_from(os.environ.get("LLMGW_GPU_CLASS_MAP", ""))
    hit = overrides.get(raw.lower())
    if hit:
        return hit
    return _from_table(raw)


@lru_cache(maxsize=1024)
def _from_table(raw: str) -> str:
    cleaned = _NOISE.sub(" ", raw.lower().replace("-", " ").replace("_", " "))
    cleaned = " ".join(cleaned.split())
    for pattern, cls in _TABLE:
        m = re.search(pattern, cleaned)
        if m:
            return cls.format(*(g or "" for g in m.groups())) if m.groups() else cls
    return cleaned.replace(" ", "") or raw.lower()


# Nominal memory of each GPU class (GiB), for fit estimates where a node does not report its GPUs'
# memory (nvidia-smi does; `LLMGW_NODE_GPUS` may, as `class:count:GiB`). Where a class comes in two
# sizes (a100 40/80, v100 16/32), the smaller.
GPU_MEMORY_GIB: dict[str, float] = {
    "b200": 180, "b100": 180, "gb200": 186, "h200": 141, "gh200": 96, "h100": 80, "h800": 80, "h20": 96,
    "a100": 40, "a800": 80, "a10g": 24, "a10": 24, "a30": 24, "a40": 48, "l40s": 48, "l40": 48, "l4": 24,
    "t4": 16, "v100": 16, "p100": 16, "rtx6000ada": 48, "a6000": 48, "a5000": 24, "a4000": 16,
    "rtx4090": 24, "rtx4080": 16, "rtx3090": 24, "rtx3090ti": 24, "rtx5090": 32, "mi300x": 192, "mi250": 128,
}


def gpu_memory_mb(gpu_class: str, reported_mb: int = 0) -> int:
    """A GPU's memory in MiB: what its node reported, else its class's nominal memory (0: unknown)."""
    return reported_mb or int(GPU_MEMORY_GIB.get(gpu_class, 0) * 1024)


def parse_gpu_spec(spec: str) -> tuple[GPUDevice, ...]:
    """`"h100:8"`, `"a10g:1,l4:2"` or `"fake:1:8"` (CLASS:COUNT[:GiB of memory each]) -> devices with
    consecutive indexes; `""` -> none.

    Raises ConfigError (variable LLMGW_NODE_GPUS) for a malformed part, so a typo stops the agent
    with a clear message instead of advertising the wrong fleet."""
    devices: list[GPUDevice] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        cls, _, rest = part.partition(":")
        count, _, mem = rest.partition(":")
        cls = cls.strip()
        if not cls:
            raise ConfigError("LLMGW_NODE_GPUS", f"missing GPU class in {part!r}")
        try:
            n = int(count) if count.strip() else 1
        except ValueError:
            raise ConfigError("LLMGW_NODE_GPUS", f"expected CLASS:COUNT[:GiB], got {part!r}") from None
        if n < 0:
            raise ConfigError("LLMGW_NODE_GPUS", f"negative GPU count in {part!r}")
        memory_mb = 0
        if mem.strip():
            try:
                memory_mb = int(float(mem) * 1024)
            except ValueError:
                raise ConfigError("LLMGW_NODE_GPUS", f"expected CLASS:COUNT:GiB (a number of GiB), got {part!r}") from None
            if memory_mb <= 0:
                raise ConfigError("LLMGW_NODE_GPUS", f"GPU memory must be positive in {part!r}")
        for _ in range(n):
            devices.append(GPUDevice(index=len(devices), gpu_class=normalize_gpu_class(cls), memory_mb=memory_mb))
    return tuple(devices)


def parse_nvidia_smi(text: str) -> tuple[GPUDevice, ...]:
    """Parse `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader[,nounits]`."""
    devices = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            index = int(parts[0])
        except ValueError:
            continue
        mem_text = parts[-1].split()[0] if parts[-1].split() else ""
        try:
            memory = int(float(mem_text))
        except ValueError:
            memory = 0
        name = ",".join(parts[1:-1])
        devices.append(GPUDevice(index=index, gpu_class=normalize_gpu_class(name), memory_mb=memory))
    return tuple(devices)
