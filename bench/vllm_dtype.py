"""How long vLLM's CPU build takes to prefill a fresh long prompt at each dtype, on one core.

    python -m bench.vllm_dtype                     # bfloat16 (the model's own) and float32
    python -m bench.vllm_dtype --dtypes float32 --requests 2

Starts the vllm engine driver's command for a one-thread CPU replica of the model `make vllm` prepared
(`llmgw.engines.selfcheck.vllm_launch_spec`, with LoRA enabled as in examples/vllm-cpu.yaml, which
also keeps vLLM from compiling the model), then sends `--requests` chat requests of 1,589 prompt
tokens (with the chat template), each with a fresh id first so no prefix cache holds it, asking for 2
tokens, one at a time. On a CPU without bfloat16 instructions (AVX2 only) vLLM's bf16 linear layers
fall back to a slow path ("Failed to create oneDNN linear, fallback to torch linear" in its log): the
reason examples/vllm-cpu.yaml runs the model at float32. Needs `make vllm`; says so and exits 1 without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import requests

from llmgw.engines.selfcheck import HOST, Engine, free_port, vllm_launch_spec

PREPARED = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmgw" / "vllm" / "current"
WORDS = " Every word here is new to the cache." * 170


def run(dtype: str, requests_n: int, logs: Path) -> list[tuple[float, int]]:
    """(seconds, prompt tokens) of each request to a fresh replica at `dtype` ("model": its own)."""
    spec = vllm_launch_spec(PREPARED, free_port(HOST), os.environ)
    extra = ["--enable-lora", "--max-lora-rank", "8"] + ([] if dtype == "model" else ["--dtype", dtype])
    spec = dataclasses.replace(spec, argv=(*spec.argv, *extra))
    engine = Engine(spec, logs / f"vllm-{dtype}.log")
    try:
        failure = engine.wait_healthy(900)
        if failure is not None:
            raise SystemExit(f"vLLM at {dtype} did not start: {failure}; its log: {logs}/vllm-{dtype}.log")
        key = spec.env.get("VLLM_API_KEY")
        took = []
        for _ in range(requests_n):
            body = {"model": "selfcheck", "max_tokens": 2,
                    "messages": [{"role": "user", "content": uuid.uuid4().hex + WORDS}]}
            t0 = time.monotonic()
            r = requests.post(engine.url + "/v1/chat/completions", json=body, timeout=900,
                              headers={"Authorization": f"Bearer {key}"} if key else {})
            r.raise_for_status()
            took.append((time.monotonic() - t0, r.json()["usage"]["prompt_tokens"]))
        return took
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="model,float32", help="comma-separated: model (its own, bfloat16), "
                    "float32, bfloat16, float16 (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=3, help="prompts per dtype (default: %(default)s)")
    args = ap.parse_args(argv)
    if not (PREPARED / "env").is_dir():
        print(f"needs vLLM's CPU build: run `make vllm` (nothing at {PREPARED})", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="llmgw-vllm-dtype-") as d:
        print(f"{'dtype':<10} {'prompt':>7} {'seconds each':<24} tokens/s")
        for dtype in args.dtypes.split(","):
            took = run(dtype, args.requests, Path(d))
            secs = [t for t, _ in took]
            rate = sum(n for _, n in took) / sum(secs)
            print(f"{dtype:<10} {took[0][1]:>7} {' '.join(f'{t:.1f}' for t in secs):<24} {rate:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
