"""GPU class normalisation, fleet specs and nvidia-smi parsing."""

from __future__ import annotations

import pytest

from llmgw.errors import ConfigError
from llmgw.gpus import gpu_memory_mb, normalize_gpu_class, parse_class_map, parse_gpu_spec, parse_nvidia_smi
from llmgw.state.node_records import GPUDevice


@pytest.mark.parametrize("name,cls", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H100 NVL", "h100"),
    ("h100", "h100"),
    ("H100", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA A10", "a10"),
    ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA L40", "l40"),
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 3090 Ti", "rtx3090ti"),
    ("rtx4090", "rtx4090"),
    ("NVIDIA RTX A6000", "a6000"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx6000ada"),
    ("  NVIDIA   Foo Bar  ", "foobar"),
])
def test_normalize(name, cls):
    assert normalize_gpu_class(name, overrides={}) == cls


def test_override_map_wins():
    overrides = parse_class_map("NVIDIA Foo=foo, NVIDIA H100 80GB HBM3=hopper")
    assert normalize_gpu_class("NVIDIA Foo", overrides) == "foo"
    assert normalize_gpu_class("nvidia h100 80gb hbm3", overrides) == "hopper"
    assert normalize_gpu_class("NVIDIA L4", overrides) == "l4"


def test_override_map_from_env(monkeypatch):
    monkeypatch.setenv("LLMGW_GPU_CLASS_MAP", "Weird Card=weird")
    assert normalize_gpu_class("Weird Card") == "weird"


@pytest.mark.parametrize("bad", ["novalue", "=x", "x="])
def test_bad_override_map(bad):
    with pytest.raises(ConfigError, match="LLMGW_GPU_CLASS_MAP"):
        parse_class_map(bad)


def test_parse_spec():
    assert parse_gpu_spec("") == ()
    assert parse_gpu_spec("h100:2") == (GPUDevice(0, "h100"), GPUDevice(1, "h100"))
    assert [(g.index, g.gpu_class) for g in parse_gpu_spec("a10g:1, L4:2")] == [(0, "a10g"), (1, "l4"), (2, "l4")]
    assert parse_gpu_spec("t4") == (GPUDevice(0, "t4"),)
    # A memory figure per GPU (GiB), as nvidia-smi would report it: what fit estimates compare with.
    assert parse_gpu_spec("fake:1:8,l4:1:23.5") == (GPUDevice(0, "fake", 8192), GPUDevice(1, "l4", 24064))


def test_gpu_memory_is_the_reported_figure_else_the_class_nominal():
    assert gpu_memory_mb("l4", 23034) == 23034
    assert gpu_memory_mb("l4") == 24 * 1024
    assert gpu_memory_mb("fake") == 0


@pytest.mark.parametrize("bad", ["h100:x", ":2", "h100:-1", "fake:1:x", "fake:1:0"])
def test_bad_spec(bad):
    with pytest.raises(ConfigError, match="LLMGW_NODE_GPUS"):
        parse_gpu_spec(bad)


def test_nvidia_smi_output():
    text = "0, NVIDIA H100 80GB HBM3, 81559 MiB\n1, NVIDIA H100 80GB HBM3, 81559\n\ngarbage\n"
    assert parse_nvidia_smi(text) == (GPUDevice(0, "h100", 81559), GPUDevice(1, "h100", 81559))
