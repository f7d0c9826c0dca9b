"""GPU class names and fleet descriptions (stub: filled in by the node-agent work).

`normalize_gpu_class("NVIDIA H100 80GB HBM3") == "h100"`: the catalog's `gpu.class` and a node's
discovered GPUs are compared after normalisation.
"""

from __future__ import annotations

from llmgw.records import GPUDevice


def normalize_gpu_class(name: str) -> str:
    return name.strip().lower()


def parse_gpu_spec(spec: str) -> tuple[GPUDevice, ...]:
    """`"h100:8"` or `"a10g:1,l4:2"` -> devices with consecutive indexes; `""` -> none."""
    devices: list[GPUDevice] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        cls, _, count = part.partition(":")
        for _ in range(int(count or 1)):
            devices.append(GPUDevice(index=len(devices), gpu_class=normalize_gpu_class(cls)))
    return tuple(devices)
