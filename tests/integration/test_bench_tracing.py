"""bench/tracing.py runs at tiny sizes and prints each case (its figures are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tracing_benchmark_smoke():
    out = subprocess.run([sys.executable, "-m", "bench.tracing", "--requests", "200", "--repeat", "1"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line[:26].strip(): line[26:].strip() for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {"off", "off, forwarded", "on (SDK, spans dropped)"}, out.stdout
    assert all(v.endswith("µs") and float(v[:-2]) >= 0 for v in rows.values()), out.stdout
