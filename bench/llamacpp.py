"""Generation and prompt tokens/s of the installed llama-server on the bundled SmolLM2 model.

    python -m bench.llamacpp [--runs 7] [--tokens 128] [--threads N] [--binary PATH ...]

Each run starts llama-server the way the node agent does (one CPU slot), warms it up with a short
request, then times one completion of exactly --tokens tokens (ignore_eos) after a fixed prompt, and
stops it; the figures are llama-server's own timings, and the median of the runs is printed (with
the range). Given several --binary, the runs alternate between them, so a machine that gets busier
or quieter during the benchmark affects every build alike. The machine's CPU model and cores head
the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import requests

from llmgw.engines.selfcheck import Engine, failure_message, launch_spec
from llmgw.proc.ports import free_port

PROMPT = ("Write a detailed story about a lighthouse keeper who finds a message in a bottle, "
          "describing the sea, the weather, the island and the people who live there.")


def cpu() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "unknown CPU")
    return f"{model}, {os.cpu_count()} cores"


def one_run(binary: str | None, threads: int, tokens: int, workdir: Path) -> dict:
    """llama-server's timings of one measured request."""
    spec = launch_spec(binary, None, free_port(), os.environ, ("-t", str(threads), "-tb", str(threads)))
    engine = Engine(spec, workdir / "llama-server.log")
    try:
        failure = engine.wait_healthy(120)
        if failure:
            sys.exit(failure_message(spec.argv[0], failure, "the benchmark"))
        body = {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "cache_prompt": False,
                "temperature": 0}
        requests.post(engine.url + "/completion", json={**body, "n_predict": 8}, timeout=120).raise_for_status()
        r = requests.post(engine.url + "/completion", json=body, timeout=600)
        r.raise_for_status()
        timings = r.json()["timings"]
        if timings["predicted_n"] != tokens:
            sys.exit(f"{spec.argv[0]}: generated {timings['predicted_n']} tokens, asked for {tokens}")
    finally:
        engine.stop()
    return timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--binary", action="append",
                    help="llama-server to measure; repeat to compare builds (default: the installed one)")
    args = ap.parse_args()
    binaries = args.binary or [None]
    gen: dict[str | None, list[float]] = {b: [] for b in binaries}
    prompt: dict[str | None, list[float]] = {b: [] for b in binaries}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as d:
        for _ in range(args.runs):
            for b in binaries:
                timings = one_run(b, args.threads, args.tokens, Path(d))
                gen[b].append(timings["predicted_per_second"])
                prompt[b].append(timings["prompt_per_second"])
    print(f"llama-server on SmolLM2-135M Q4_1, {cpu()}, -t {args.threads}, {args.runs} runs of "
          f"{args.tokens} generated tokens (median, min-max):")
    for b in binaries:
        name = b or launch_spec(None, None, 0, os.environ).argv[0]
        g, p = gen[b], prompt[b]
        print(f"  {name}\n    generation {statistics.median(g):6.1f} tokens/s ({min(g):.1f}-{max(g):.1f})"
              f"   prompt {statistics.median(p):6.1f} tokens/s ({min(p):.1f}-{max(p):.1f})")


if __name__ == "__main__":
    main()
