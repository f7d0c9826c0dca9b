"""bench/routing.py runs end to end, tiny: real engines, the gateway under gunicorn, its baselines and
whichever peers are installed, one short load; it prints a row per router and the verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def table(stdout: str) -> list[dict[str, str]]:
    """The 80 % rows, by the header's column names (`load router p50 ... err/n served`)."""
    lines = stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("  load"))
    return [dict(zip(header, line.split())) for line in lines if line.startswith("  80%")]


def test_routing_benchmark_smoke(tmp_path):
    plot = tmp_path / "p99.png"
    out = subprocess.run(
        [sys.executable, "-m", "bench.routing", "--quick", "--loads", "0.8", "--seconds", "1.5",
         "--warmup", "0.5", "--routers", "llmgw,least_inflight,nginx,vllm-p2", "--plot", str(plot)],
        capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = table(out.stdout)
    routers = {r["router"] for r in rows}
    assert {"llmgw", "least_inflight"} <= routers, out.stdout
    for r in rows:
        errors, n = r["err/n"].split("/")
        assert int(n) > 0 and int(errors) == 0, r  # every request answered
        served = [int(x) for x in r["served"].split("/")]
        assert sum(served) == int(n), r  # each answer's engine was identified
    assert float(next(r for r in rows if r["router"] == "llmgw")["cpu_ms"]) > 0  # its CPU per request
    assert "llmgw / best peer" in out.stdout and "fleet-a" in out.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.stat().st_size > 1000


def test_routing_benchmark_conversations_on_llamacpp_engines_smoke():
    """`--workload mix --make llamacpp`: bench/prefix.py's sessions and one-shot requests on engines in
    llama.cpp's personality; each row has the hit ratio from the engines' own counters."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.routing", "--quick", "--seconds", "1.5", "--warmup", "0.5",
         "--workload", "mix", "--make", "llamacpp", "--routers", "llmgw,nginx", "--plot", ""],
        capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mix on llamacpp engines" in out.stdout and "burst" not in out.stdout
    rows = table(out.stdout)
    assert "llmgw" in {r["router"] for r in rows}, out.stdout
    for r in rows:
        errors, n = r["err/n"].split("/")
        assert int(n) > 0 and int(errors) == 0, r
        assert sum(int(x) for x in r["served"].split("/")) == int(n), r
    # later turns of a session that came back to the slot holding its history were reused
    assert any(float(r["hits"].rstrip("%")) > 0 for r in rows), out.stdout
