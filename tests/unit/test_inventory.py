"""Node inventory: GPUs from LLMGW_NODE_GPUS or nvidia-smi, memory from /proc/meminfo."""

from __future__ import annotations

from llmgw.state.node_records import GPUDevice
from workers.agent.config import AgentSettings
from workers.agent.inventory import discover_gpus, memory_mb, node_info


def test_spec_overrides_nvidia_smi():
    called = []
    assert discover_gpus("l4:1", smi=lambda: called.append(1) or "0, NVIDIA H100, 1 MiB") == (GPUDevice(0, "l4"),)
    assert discover_gpus("", smi=lambda: "0, NVIDIA H100, 1 MiB") == ()
    assert not called


def test_nvidia_smi_used_when_no_spec():
    assert discover_gpus(None, smi=lambda: "0, Tesla T4, 15360 MiB\n") == (GPUDevice(0, "t4", 15360),)
    assert discover_gpus(None, smi=lambda: None) == ()


def test_memory(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    assert memory_mb(f) == 16000
    assert memory_mb(tmp_path / "missing") == 0


def test_node_info():
    s = AgentSettings(node_name="gpu01", node_address="10.0.0.5", node_pool="p", node_labels={"zone": "z1"})
    info = node_info(s, (GPUDevice(0, "h100"),), started_at=5.0, now=7.0)
    assert (info.name, info.address, info.pool, info.labels) == ("gpu01", "10.0.0.5", "p", {"zone": "z1"})
    assert info.heartbeat_at == 7.0 and info.agent_started_at == 5.0 and info.agent_pid > 0
    assert info.cpu_cores >= 1 and info.memory_mb > 0
