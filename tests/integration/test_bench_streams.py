"""bench/streams.py runs end to end at tiny sizes (its figures are printed, never asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_streams_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, "-m", "bench.streams", "--levels", "4", "--seconds", "1", "--answer", "0.2",
         "--targets", "direct,llmgw,floor-gunicorn,floor-gevent"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("4 ")]
    targets = {r[1] for r in rows}
    assert {"direct", "llmgw", "floor-gunicorn", "floor-gevent"} <= targets, out.stdout
    for r in rows:
        assert float(r[2]) > 0 and r[7] == "0", out.stdout  # requests flowed, and none failed
    llmgw = next(r for r in rows if r[1] == "llmgw")
    assert llmgw[8] != "-" and llmgw[9] != "-", out.stdout  # the gateway's CPU and RSS were measured
