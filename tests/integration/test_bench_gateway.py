"""bench/gateway.py runs end to end at a tiny size (its figures are printed, never asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import needs

ROOT = Path(__file__).resolve().parents[2]


def test_gateway_benchmark_smoke():
    needs.wrk()
    out = subprocess.run([sys.executable, "-m", "bench.gateway", "--seconds", "1", "--workers", "1",
                          "--targets", "direct,llmgw,floor-proxy"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith(("direct", "llmgw", "floor"))]
    assert {r[0] for r in rows} == {"direct", "llmgw", "floor-proxy"} and len(rows) == 12, out.stdout
    for r in rows:
        assert float(r[1]) > 0 and r[-1] == "0", out.stdout  # requests flowed, and none failed
        assert r[0] == "direct" or r[6] != "-", out.stdout  # the proxies' CPU per request was measured
