"""Download throughput of llmgw's weights downloader against curl, from the same loopback server.

    python -m bench.download [--size-mb 400] [--runs 3]

Writes a file of --size-mb MiB to a temp dir, serves it from the loopback hub of the tests
(harness/fakehub.py, in its own process) as a plain URL and as a hub repository, then times,
alternately, `curl -o` of the URL, the downloader on the URL source (with #sha256 verification) and
on the hf:// source (model-info call, redirect to the CDN listener, sha256 against the ETag); and
curl followed by an fsync of its file, since llmgw syncs a file before it names it complete. Each
run starts from an empty cache; huggingface_hub is imported before the clock starts (the agent
imports it once). Prints the median MiB/s of each and the range.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import huggingface_hub  # noqa: F401 - imported once per agent process: not part of a download's time
import requests

from llmgw.weights.download import Downloader

MIB = 1024 * 1024


def write_file(path: Path, size_mb: int) -> str:
    block = os.urandom(MIB)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for i in range(size_mb):
            chunk = block[i % 256:] + block[:i % 256]  # not one repeated block: no compression helps anyone
            f.write(chunk)
            h.update(chunk)
    return h.hexdigest()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=400)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if not shutil.which("curl"):
        sys.exit("curl is not installed")
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-download-") as tmp:
        tmp = Path(tmp)
        src = tmp / "weights.gguf"
        sha = write_file(src, args.size_mb)
        server = subprocess.Popen([sys.executable, "-m", "harness.fakehub", str(src)], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            info = json.loads(server.stdout.readline())
            url = info["urls"][src.name]
            env = {"HF_ENDPOINT": info["endpoint"]}
            session = requests.Session()  # the agent keeps one (connection reuse), as curl's one run has one

            def curl(sync=False):
                def run():
                    subprocess.run(["curl", "-s", "-f", "-o", str(tmp / "curl.out"), url], check=True)
                    if sync:  # on disk for sure, as llmgw makes a file before it names it complete
                        fd = os.open(tmp / "curl.out", os.O_RDONLY)
                        os.fsync(fd)
                        os.close(fd)
                    (tmp / "curl.out").unlink()
                return run

            def ours(source):
                def run():
                    cache = tmp / "cache"
                    shutil.rmtree(cache, ignore_errors=True)
                    Downloader(cache, environ=env, session=session).ensure(source, "llamacpp")
                    shutil.rmtree(cache)
                return run

            cases = {"curl -o": curl(), "curl -o, then fsync": curl(sync=True), "llmgw, https:// source (#sha256)": ours(f"{url}#sha256={sha}"),
                     "llmgw, hf:// source (sha256 = ETag)": ours(f"hf://bench/{src.stem}/{src.name}")}
            times: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(args.runs):
                for name, fn in cases.items():
                    times[name].append(timed(fn))
        finally:
            server.terminate()
            server.wait(30)
    print(f"{args.size_mb} MiB from a loopback server (harness/fakehub.py), {args.runs} runs, "
          f"{os.cpu_count()} cores")
    for name, ts in times.items():
        rates = [args.size_mb / t for t in ts]
        print(f"  {name:40s} {statistics.median(rates):8.1f} MiB/s  (range {min(rates):.1f}-{max(rates):.1f})")


if __name__ == "__main__":
    main()
