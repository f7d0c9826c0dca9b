"""One closed-loop load run with wrk (Debian package `wrk`): the same load generator, in C, for every
target of bench/gateway.py, so the client's own cost is small and equal for all.

`run(url, body, connections, seconds)` posts `body` to /v1/chat/completions on `connections`
keep-alive connections from one wrk thread and returns requests, req/s, latency p50/p99 (whole
answer, streams included) and errors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SCRIPT = """
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = %s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%d %%d %%d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.connect + e.read + e.write + e.status + e.timeout))
end
"""


@dataclass(frozen=True)
class Run:
    requests: int
    rps: float
    p50: float  # seconds
    p99: float
    errors: int


def available() -> bool:
    return shutil.which("wrk") is not None


def run(url: str, body: bytes, connections: int, seconds: float) -> Run:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(SCRIPT % json.dumps(body.decode()))
        script = f.name
    try:
        out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "30s",
                              "-s", script, url], capture_output=True, text=True, timeout=seconds + 60)
    finally:
        Path(script).unlink(missing_ok=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            n, dur_us, p50, p99, errors = (int(x) for x in line.split()[1:])
            return Run(n, n / (dur_us / 1e6), p50 / 1e6, p99 / 1e6, errors)
    raise RuntimeError(f"wrk printed no result for {url}: {out.stdout[-500:]} {out.stderr[-500:]}")
