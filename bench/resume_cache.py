"""What share of a resumed prefill each engine serves from its cache.

    python -m bench.resume_cache [--prompt-words 500] [--cut 32] [--runs 3] [--cache-ram 256]
                                 [--vllm DIR | --no-vllm]

An answer the gateway evicts (or whose engine breaks off) is resumed by a second request: the prompt
plus the text said so far as an assistant message the engine continues (`gateway.upstream.resume
.continuation`). Its prefill is prompt + said tokens; whatever the engine still holds of them it does
not compute again. For each engine this starts a real server on the bundled SmolLM2-135M, sends a
long prompt streamed at temperature 0, closes the connection after `--cut` tokens (what an eviction
does), then sends the continuation streamed, and prints the prompt tokens the engine reports as
cached, how many it computed again, and the continuation's time to first token. Scenarios:

- `at once`: resumed on the same replica right away (its slot, or its freed blocks, still hold it);
- `after another prompt`: another long prompt took the replica's only slot (llama.cpp, `-np 1`) or
  its whole KV cache (vLLM, a KV cache of `--vllm-blocks` blocks) before the resume: llama.cpp then
  restores the evicted slot's KV from its host-memory prompt cache (`--cache-ram`), and the same is
  run with `--cache-ram 0` for comparison; vLLM has only what is left of its prefix cache;
- `cold`: the same continuation on a freshly started replica, for the prefill time with nothing cached.

llama-server reports `timings.cache_n` and `timings.prompt_n` (cached + computed = the prompt); vLLM
reports `usage.prompt_tokens_details.cached_tokens` (started with --enable-prompt-tokens-details).
vLLM runs from the environment `make vllm` prepared (`--vllm DIR`, default the one the vllm engine
driver finds); without it only llama.cpp is measured, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from gateway.upstream.resume import Said, continuation
from llmgw import surface as op
from llmgw.catalog import Model, Profile
from llmgw.engines.base import LaunchContext, LaunchSpec
from llmgw.engines.llamacpp import DEFAULT_MODEL, LlamaCppDriver
from llmgw.engines.selfcheck import HOST, VLLM_MODEL, VLLM_PYTHON, Engine, failure_message
from llmgw.engines.vllm import VllmDriver, prepared_env
from llmgw.proc.ports import free_port

TOPICS = ("the lighthouse", "the harbour", "the storm", "the ferry", "the market", "the school", "the orchard",
          "the mill", "the bridge", "the chapel", "the quarry", "the fishing fleet")
MAX_TOKENS = 400  # of the first answer: it is cut long before
CONTINUED = 4  # tokens the continuation generates: only its prefill is measured


def long_prompt(words: int, seed: int) -> str:
    """A deterministic prompt of about `words` words (different for each `seed`), asking for a story."""
    parts, n, i = [], 0, 0
    while n < words:
        topic = TOPICS[(i + seed) % len(TOPICS)]
        s = (f"Note {seed}.{i}: on day {i * 7 + seed} the islanders talked about {topic}, which had changed "
             f"since the year {1800 + i * 3 + seed} when the old keeper wrote about it in his log. ")
        parts.append(s)
        n += len(s.split())
        i += 1
    return "".join(parts) + "\nUsing these notes, write a long and detailed story about the island."


@dataclass(frozen=True)
class Resumed:
    """One resumed prefill, as its engine reported it."""

    prompt: int  # the continuation's prompt tokens (prompt + said)
    cached: int  # served from the engine's cache
    ttft: float  # seconds from sending the continuation to its first token

    @property
    def computed(self) -> int:
        return self.prompt - self.cached


def _events(r: requests.Response):
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def cut_after(url: str, body: dict, tokens: int) -> Said:
    """Stream `body`, close the connection after `tokens` content chunks (an eviction), and return
    what the client was said."""
    text, n = [], 0
    with requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=300) as r:
        r.raise_for_status()
        for event in _events(r):
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    n += 1
            if n >= tokens:
                break
    return Said(text=json.dumps("".join(text))[1:-1].encode(), tokens=n)


def resume(url: str, body: dict, said: Said) -> Resumed:
    """Send the continuation of `body` after `said`, streamed; what the engine says it reused."""
    cont = continuation(op.CHAT, {**body, "max_tokens": CONTINUED}, said)
    cont.update(stream=True, stream_options={"include_usage": True}, max_tokens=CONTINUED)
    started = time.monotonic()
    ttft = None
    prompt = cached = None
    with requests.post(url + "/v1/chat/completions", json=cont, stream=True, timeout=300) as r:
        if r.status_code != 200:
            sys.exit(f"the continuation was refused: HTTP {r.status_code}: {r.text[:300]}")
        for event in _events(r):
            if ttft is None and any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                ttft = time.monotonic() - started
            timings = event.get("timings")
            if timings and "cache_n" in timings:  # llama-server: on every chunk, final on the last
                cached, prompt = timings["cache_n"], timings["cache_n"] + timings["prompt_n"]
            usage = event.get("usage")
            if usage and usage.get("prompt_tokens") is not None and "cache_n" not in (timings or {}):
                prompt = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if prompt is None or cached is None:
        sys.exit("the engine reported no prompt tokens for the continuation")
    return Resumed(prompt, cached, ttft if ttft is not None else time.monotonic() - started)


def idle(url: str, engine: str) -> None:
    """Wait until the engine runs nothing (the cut request's end noticed), at most 30 s."""
    series = "llamacpp:requests_processing" if engine == "llamacpp" else "vllm:num_requests_running"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = requests.get(url + "/metrics", timeout=5).text
        values = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(series)]
        if values and sum(values) == 0:
            return
        time.sleep(0.05)
    sys.exit(f"{url}: still running a request 30 s after its client left")


def filler(url: str, words: int, seed: int) -> None:
    """Another long prompt that takes the slot (or the KV cache) the cut answer held."""
    r = requests.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "m", "messages": [{"role": "user", "content": long_prompt(words, seed)}], "max_tokens": 1,
        "temperature": 0})
    r.raise_for_status()


class Server:
    """One engine process for the benchmark; a context manager that stops it."""

    def __init__(self, spec: LaunchSpec, workdir: Path, name: str, timeout: float):
        self.spec, self.name = spec, name
        self.engine = Engine(spec, workdir / f"{name}.log")
        try:
            failure = self.engine.wait_healthy(timeout)
        except BaseException:  # interrupted while it starts (Ctrl-C, `timeout -s INT`): no engine left behind
            self.engine.stop()
            raise
        if failure:
            self.engine.stop()
            sys.exit(failure_message(spec.argv[0], failure, "the benchmark", engine=name))
        self.url = self.engine.url

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.engine.stop()


def llamacpp_spec(cache_ram: int, slots: int = 1) -> LaunchSpec:
    profile = Profile(name="bench", engine="llamacpp", capacity=slots, cache_ram=cache_ram,
                      args=["-t", str(os.cpu_count() or 1)])
    m = Model(name="m", source=DEFAULT_MODEL, profiles=[profile])
    return LlamaCppDriver().command(LaunchContext(replica_id="bench", model=m, profile=profile, host=HOST,
                                                  port=free_port(HOST)))


def vllm_spec(directory: Path, blocks: int) -> LaunchSpec:
    env = {**os.environ, "LLMGW_VLLM_PYTHON": str(directory / VLLM_PYTHON)}
    env.pop("LLMGW_VLLM", None)
    profile = Profile(name="bench", engine="vllm", device="cpu", threads=os.cpu_count() or 1,
                      args=["--max-model-len", "2048", "--enable-prompt-tokens-details",
                            "--num-gpu-blocks-override", str(blocks)])
    m = Model(name="m", source=str(directory / VLLM_MODEL), profiles=[profile])
    return VllmDriver(environ=env).command(LaunchContext(replica_id="bench", model=m, profile=profile, host=HOST,
                                                         port=free_port(HOST)))


def body_for(words: int, seed: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": long_prompt(words, seed)}],
            "max_tokens": MAX_TOKENS, "temperature": 0}


def scenario(server: Server, engine: str, words: int, cut: int, seed: int, other: bool) -> Resumed:
    body = body_for(words, seed)
    said = cut_after(server.url, body, cut)
    idle(server.url, engine)
    if other:
        filler(server.url, words, seed + 1000)
    return resume(server.url, body, said)


def cold(spec_of, engine: str, workdir: Path, words: int, cut: int, seed: int, timeout: float) -> Resumed:
    """The continuation on a replica that never saw the prompt: nothing cached (the cut is made on
    another one first, to know what was said)."""
    body = body_for(words, seed)
    with Server(spec_of(), workdir, engine, timeout) as first:
        said = cut_after(first.url, body, cut)
    with Server(spec_of(), workdir, engine, timeout) as second:
        return resume(second.url, body, said)


def row(label: str, runs: list[Resumed]) -> str:
    r = runs[len(runs) // 2] if len(runs) % 2 else runs[0]
    share = statistics.median(x.cached / x.prompt for x in runs)
    ttft = statistics.median(x.ttft for x in runs)
    return (f"| {label} | {r.prompt} | {statistics.median(x.cached for x in runs):.0f} | "
            f"{statistics.median(x.computed for x in runs):.0f} | {share:.1%} | {ttft * 1000:.0f} ms |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.resume_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-words", type=int, default=500, help="length of the prompt (about 1.4 tokens a word)")
    ap.add_argument("--cut", type=int, default=32, help="tokens said before the answer is cut off")
    ap.add_argument("--runs", type=int, default=3, help="runs of each scenario (the medians are printed)")
    ap.add_argument("--cache-ram", type=int, default=256, help="llama-server's prompt cache, MiB")
    ap.add_argument("--vllm", type=Path, default=None, help="the vLLM environment `make vllm` prepared")
    ap.add_argument("--no-vllm", action="store_true", help="measure llama.cpp only")
    ap.add_argument("--vllm-blocks", type=int, default=20,
                    help="vLLM's KV cache in 128-token blocks: small enough for another prompt to fill it")
    args = ap.parse_args(argv)
    vllm_dir = None if args.no_vllm else (args.vllm or prepared_env(os.environ))
    if vllm_dir is not None and not (vllm_dir / VLLM_PYTHON).is_file():
        vllm_dir = None
    w, cut = args.prompt_words, args.cut
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as d:
        work = Path(d)
        with Server(llamacpp_spec(args.cache_ram), work, "llamacpp", 120) as s:
            rows.append(row("llama.cpp, at once", [scenario(s, "llamacpp", w, cut, i, False) for i in range(args.runs)]))
            rows.append(row(f"llama.cpp, after another prompt, --cache-ram {args.cache_ram}",
                            [scenario(s, "llamacpp", w, cut, i, True) for i in range(args.runs)]))
        with Server(llamacpp_spec(0), work, "llamacpp", 120) as s:
            rows.append(row("llama.cpp, after another prompt, --cache-ram 0",
                            [scenario(s, "llamacpp", w, cut, i, True) for i in range(args.runs)]))
        rows.append(row("llama.cpp, cold (another replica)",
                        [cold(lambda: llamacpp_spec(args.cache_ram), "llamacpp", work, w, cut, 0, 120)]))
        if vllm_dir is not None:
            with Server(vllm_spec(vllm_dir, args.vllm_blocks), work, "vllm", 900) as s:
                rows.append(row("vLLM, at once", [scenario(s, "vllm", w, cut, i, False) for i in range(args.runs)]))
                rows.append(row(f"vLLM, after another prompt ({args.vllm_blocks} KV blocks)",
                                [scenario(s, "vllm", w, cut, i, True) for i in range(args.runs)]))
    print(f"Resumed prefills: a {w}-word prompt cut after {cut} tokens, SmolLM2-135M, {os.cpu_count()} cores, "
          f"median of {args.runs} runs")
    print("| engine, when resumed | prompt + said (tokens) | cached | computed again | served from cache | TTFT |")
    print("|---|---|---|---|---|---|")
    for line in rows:
        print(line)
    if vllm_dir is None:
        print("vLLM: not measured (no environment from `make vllm`; or --no-vllm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
