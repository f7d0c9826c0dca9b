"""bench/gpu_check.py's dry run (`--cpu-only`) end to end: every step of the GPU check but the CUDA
build and NVML, on real processes (llmgw up, two llama-server replicas, one of them placed on a
simulated card), so the script a GPU session runs in its one call is known to work up to the GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_passes_every_check_it_can_make_without_a_gpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu-only", "--work", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=540, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    lines = text.splitlines()
    assert not [ln for ln in lines if ln.lstrip().startswith("FAIL")], text
    oks = [ln for ln in lines if ln.lstrip().startswith("ok ")]
    assert len(oks) >= 12, text
    assert any("gpu replica: record's GPUs {'gpu-node': [0]}" in ln and "CUDA_VISIBLE_DEVICES='0'" in ln for ln in oks), text
    assert any("cpu replica: record's GPUs {}" in ln and "CUDA_VISIBLE_DEVICES=''" in ln for ln in oks), text
    assert any("Ready in" in ln and "on GPUs {'gpu-node': [0]}" in ln for ln in oks), text  # the kill -9
    # What only a GPU shows is said to be skipped, never passed.
    skips = [ln for ln in lines if ln.lstrip().startswith("SKIP")]
    assert any("the CUDA build" in ln for ln in skips) and any("NVML" in ln for ln in skips), text
    assert "every check passed" in lines[-1], text
