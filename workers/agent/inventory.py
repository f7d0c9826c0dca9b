"""What this node has: CPU cores, memory and GPUs, for its heartbeat.

GPUs come from `LLMGW_NODE_GPUS` when set (`"h100:8"`, `"a10g:1,l4:2"`, `""` for none), else from
`nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits` when it exists, else
none. The command runner is a parameter so tests need no GPU.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from llmgw.gpus import parse_gpu_spec, parse_nvidia_smi
from llmgw.state.records import GPUDevice, NodeInfo
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
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def node_info(settings: AgentSettings, gpus: tuple[GPUDevice, ...], started_at: float, now: float) -> NodeInfo:
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
    )
