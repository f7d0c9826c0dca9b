"""bench/slo.py runs end to end, tiny: one fleet over capacity, llmgw with the requests' latency targets
and the same llmgw without them, on the same traffic; it prints a row per mode and class."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rows(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """The table's rows by (mode, class), by the header's column names (`load mode class n goodput ...`)."""
    lines = stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("  load"))
    out = {}
    for line in lines:
        cells = line.split()
        if line.startswith("  110%") and len(cells) == len(header):
            r = dict(zip(header, cells))
            out[(r["mode"], r["class"])] = r
    return out


def test_slo_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, "-m", "bench.slo", "--fleets", "fleet-a", "--loads", "1.1", "--seconds", "12",
         "--modes", "on,off"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = rows(out.stdout)
    assert set(table) == {(m, c) for m in ("on", "off") for c in ("tight", "lax")}, out.stdout
    for r in table.values():  # every request is answered within its targets, refused or late
        n, good = int(r["n"]), float(r["goodput"].rstrip("%")) / 100
        assert n > 0 and round(good * n) + int(r["429-now"]) + int(r["later"]) + int(r["late"]) == n, r
    on, off = table[("on", "tight")], table[("off", "tight")]
    # Over capacity, the tight class gets its first token in time far more often when llmgw knows the
    # target; a strict request it cannot serve in time is refused, never served late.
    assert float(on["goodput"].rstrip("%")) >= float(off["goodput"].rstrip("%")) + 20.0, out.stdout
    assert int(on["late"]) == 0 and int(off["late"]) > 0, out.stdout
    # ... at no cost in throughput
    assert float(on["x-off"]) >= 0.95, out.stdout
    assert "predictor (on): first-token error" in out.stdout, out.stdout
