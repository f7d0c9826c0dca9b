"""What this node has: CPU cores, memory and GPUs, for its heartbeat.

GPUs come from `LLMGW_NODE_GPUS` when set (`"h100:8"`, `"a10g:1,l4:2"`, `""` for none), else from
`nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits` when it exists, else
none. The command runner is a parameter so tests need no GPU. Discovered GPUs are read for health
every heartbeat (`GpuHealth`: NVML through `nvidia-ml-py`, else `nvidia-smi -q`;
`llmgw.weights.gpuhealth` decides), and an event says when one turns unhealthy or healthy again.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import dataclasses

from llmgw.gpus import parse_gpu_spec, parse_nvidia_smi
from llmgw.state.node_records import GPUDevice, NodeInfo
from llmgw.weights import gpuhealth
from llmgw.weights.gpuhealth import Health, Reading
from workers.agent.config import AgentSettings

log = logging.getLogger("llmgw.agent")

NVIDIA_SMI_ARGS = ("--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits")


def run_nvidia_smi() -> str | None:
    """nvidia-smi's output, or None when there is no nvidia-smi or it fails (no driver)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, *NVIDIA_SMI_ARGS], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("nvidia-smi failed: %s", e)
        return None
    if out.returncode != 0:
        log.warning("nvidia-smi exited %d: %s", out.returncode, out.stderr.strip()[:200])
        return None
    return out.stdout


def discover_gpus(spec: str | None, smi: Callable[[], str | None] = run_nvidia_smi) -> tuple[GPUDevice, ...]:
    if spec is not None:
        return parse_gpu_spec(spec)
    text = smi()
    return parse_nvidia_smi(text) if text else ()


def cpu_cores() -> int:
    return len(core_ids())


def core_ids() -> tuple[int, ...]:
    """The CPU cores this process may run on (its affinity), which the engines it starts inherit."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def memory_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def node_info(settings: AgentSettings, gpus: tuple[GPUDevice, ...], started_at: float, now: float,
              weights=None) -> NodeInfo:
    """`weights`: the node's cache (`workers.agent.weights.CacheReport`), when known."""
    cached = {} if weights is None else dict(weights=weights.entries, weights_dir=weights.where,
                                             weights_free=weights.free, weights_room=weights.room,
                                             weights_budget=weights.budget)
    return NodeInfo(
        name=settings.node_name,
        address=settings.node_address,
        cpu_cores=cpu_cores(),
        memory_mb=memory_mb(),
        gpus=gpus,
        pool=settings.node_pool,
        labels=dict(settings.node_labels),
        heartbeat_at=now,
        agent_started_at=started_at,
        agent_pid=os.getpid(),
        **cached,
    )


def health_changes(previous: dict[int, Health], current: dict[int, Health]) -> list[Health]:
    """The GPUs whose verdict flipped (or that read unhealthy the first time), for an event each."""
    out = []
    for i, h in sorted(current.items()):
        before = previous.get(i)
        if (before is None and not h.healthy) or (before is not None and before.healthy != h.healthy):
            out.append(h)
    return out


def with_health(gpus: tuple[GPUDevice, ...], health: dict[int, Health]) -> tuple[GPUDevice, ...]:
    return tuple(dataclasses.replace(g, healthy=health[g.index].healthy, health=health[g.index].reason)
                 if g.index in health else g for g in gpus)


class GpuHealth:
    """The verdict on each GPU of this node, read every heartbeat; `emit(kind, message)` for a change."""

    def __init__(self, read: Callable[[], list[Reading] | None], emit: Callable[[str, str], None]):
        self.read, self.emit = read, emit
        self.previous: dict[int, Health] = {}

    def step(self, gpus: tuple[GPUDevice, ...], now: float) -> tuple[GPUDevice, ...]:
        try:
            readings = self.read()
        except Exception as e:  # noqa: BLE001 - no verdict this time rather than no heartbeat
            log.warning("reading GPU health failed: %s", e)
            readings = None
        if readings is not None:
            current = gpuhealth.verdicts(readings, self.previous, now)
            for h in health_changes(self.previous, current):
                if h.healthy:
                    self.emit("gpu_healthy", f"GPU {h.index} is healthy again: it gets replicas again")
                else:
                    self.emit("gpu_unhealthy", f"GPU {h.index} is unhealthy: {h.reason}; its replicas are "
                                               "replaced elsewhere and it gets no new one")
            self.previous = {**self.previous, **current}
        return with_health(gpus, self.previous)


def health_reader(spec: str | None) -> Callable[[], list[Reading] | None] | None:
    """How this node reads GPU health: NVML, else `nvidia-smi -q`; None with LLMGW_NODE_GPUS set (its
    GPUs are declared, not discovered) or without either."""
    if spec is not None:
        return None
    try:
        return gpuhealth.NvmlReader().read
    except Exception as e:  # noqa: BLE001 - no nvidia-ml-py, no driver: the fallback
        log.info("NVML is not available (%s); GPU health from nvidia-smi if present", e)
    if shutil.which("nvidia-smi") is None:
        return None
    return gpuhealth.read_nvidia_smi
