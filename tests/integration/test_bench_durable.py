"""bench/durable.py runs at a tiny size and prints each case (its figures are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_durable_benchmark_smoke():
    out = subprocess.run([sys.executable, "-m", "bench.durable", "--n", "5"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("catalog apply", "key creation"))]
    assert len(rows) == 6 and all(line.rstrip().endswith("ms") for line in rows), out.stdout
    assert any("WAIT for 1 replica" in line for line in rows), out.stdout
