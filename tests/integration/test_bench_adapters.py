"""bench/adapters.py runs end to end, tiny: sim engines serving adapters behind llmgw's gateway, with
llmgw's placement and with routing that ignores adapters; each prints a row, every request answered."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_adapters_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, "-m", "bench.adapters", "--quick", "--engines", "2", "--adapters", "4",
         "--max-loras", "2", "--seconds", "3", "--modes", "llmgw,base-only"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.startswith("  ") and line.split()[0] in ("llmgw", "base-only")}
    assert set(rows) == {"llmgw", "base-only"}, out.stdout
    for r in rows.values():
        errors, n = r[7].split("/")
        assert int(n) > 0 and int(errors) == 0, r
        assert float(r[1]) > 0, r
