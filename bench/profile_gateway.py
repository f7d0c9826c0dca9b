"""Where the gateway's CPU goes on streamed chat traffic: its CPU time per request, and with py-spy
(`pip install py-spy`) the functions one worker spends it in.

    python -m bench.profile_gateway [--conversations 40] [--workers 1] [--spy] [--top 25]

The traffic is bench/prefix.py's (conversations with shared system prompts and one-shot prompts,
all streamed) on its four simulated vLLM engines, through llmgw's gateway as bench/routing.py
starts it. Printed: requests, the gateway's CPU milliseconds per request (gunicorn's master and
workers), and with `--spy` each function's share of one worker's samples, inclusive and self.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.fleets import Fleet, prefix_engines
from bench.peers import cpu_seconds
from bench.routing import Router, RunningFleet
from bench.traffic import run_traffic, workload
from harness.cluster import Cluster
from harness.procs import bin_path


def shares(raw: Path, top: int) -> list[str]:
    """py-spy's raw output (one `frame;frame;... count` a line) as each function's share."""
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        frames = [re.sub(r":\d+\)", ")", f) for f in stack.split(";")]
        for f in set(frames):
            inclusive[f] += int(n)
        own[frames[-1]] += int(n)
    out = [f"{total} samples; inclusive:"]
    out += [f"  {100 * v / total:5.1f}%  {k[:120]}" for k, v in inclusive.most_common(top)]
    out += ["self:"] + [f"  {100 * v / total:5.1f}%  {k[:120]}" for k, v in own.most_common(top)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--workers", default="1", help="LLMGW_GATEWAY_WORKERS (py-spy records the first worker)")
    ap.add_argument("--spy", action="store_true", help="record one worker with py-spy and print where it spends")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    spy_bin = shutil.which(bin_path("py-spy")) or shutil.which("py-spy")
    if a.spy and not spy_bin:
        ap.error("--spy needs py-spy: pip install py-spy")
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-profile-"))
    cluster = Cluster(workdir)
    rf = router = None
    try:
        cluster.start_redis()
        rf = RunningFleet(cluster, Fleet("prefix", prefix_engines(False), make="vllm"), "profile")
        router = Router("llmgw", cluster, rf, workdir, a.workers)
        pids = router.pids()  # gunicorn's master, then its workers
        spy, raw, said = None, workdir / "spy.txt", workdir / "spy.err"
        if a.spy:
            worker = next(p for p in pids if p != pids[0])
            with said.open("w") as err:
                spy = subprocess.Popen([spy_bin, "record", "-p", str(worker), "-o", str(raw), "-f", "raw", "-r", "200",
                                        "--nonblocking"], stdout=subprocess.DEVNULL, stderr=err)
        c0, t0 = cpu_seconds(pids), time.monotonic()
        results = run_traffic(router.url, workload(a.conversations, 2.0, 0.2, 1))
        used = cpu_seconds(pids) - c0
        ok = sum(r.status == 200 for r in results)
        print(f"{len(results)} requests ({ok} answered) in {time.monotonic() - t0:.0f} s; gateway CPU "
              f"{1000 * used / max(1, len(results)):.2f} ms a request ({a.workers} worker(s) and the master)")
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
            spy.wait(30)
            if not raw.exists():  # it could not attach (ptrace not permitted, say): its own words
                print(f"py-spy recorded nothing: {said.read_text().strip()[-500:]}")
                return 1
            print("\n".join(shares(raw, a.top)))
    finally:
        if router is not None:
            router.stop()
        if rf is not None:
            rf.stop()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
