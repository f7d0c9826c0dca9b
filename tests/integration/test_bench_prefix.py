"""bench/prefix.py runs end to end, tiny: engines with a prefix cache, llmgw's gateway (one, and two
behind round robin) and whichever cache-aware peers are installed; each prints a row with the engines'
own hit ratio."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prefix_benchmark_smoke():
    peers = [p for p in ("vllm-router", "smg") if shutil.which(str(Path(sys.executable).parent / p))]
    if os.environ.get("LLMGW_CI") and "vllm-router" not in peers:
        # CI installs the bench extra only when it runs the benchmarks: llmgw alone is still measured.
        peers = []
    routers = ",".join(["llmgw", "llmgw-2gw"] + [{"vllm-router": "vllm-cache", "smg": "smg"}[p] for p in peers])
    out = subprocess.run(
        [sys.executable, "-m", "bench.prefix", "--quick", "--conversations", "4", "--rate", "4",
         "--routers", routers], capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith("  ")
            and line.split()[0] in ("llmgw", "llmgw-2gw", "vllm-cache", "smg")}
    assert set(rows) == set(routers.split(",")), out.stdout
    for r in rows.values():
        errors, n = r[6].split("/")
        assert int(n) > 0 and int(errors) == 0, r
        assert sum(int(x) for x in r[8].split("/")) == int(n), r  # every answer's engine identified
        assert float(r[7].rstrip("%")) > 0, r  # later turns hit the cache
        moved, later = r[10].split("/")
        assert r[9] == "moved" and 0 <= int(moved) <= int(later), r
