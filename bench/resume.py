"""What a resume costs a stream: kill -9 one of two engines while streams run on both, and print the
gap each moved stream saw at its seam (from the last token before the kill to the first after it),
next to the ordinary gap between two tokens.

    python -m bench.resume [--engine sim|llamacpp] [--streams 16] [--tokens 200] [--runs 3]
    python -m bench.resume --per-piece [--tokens 2000]

Each run starts two engines (the simulated engine, or llama-server on the bundled SmolLM2 at
temperature 0, `-np` as many slots as streams, one thread each), publishes both to a real Redis,
starts the gateway under gunicorn (the relay path users get) and sends `--streams` concurrent
streamed chat requests of `--tokens` tokens (`ignore_eos`), alternating between two prompts. Once
every stream has `--kill-at` tokens, the engine serving most of them is killed with SIGKILL. Each
stream must still end with a finish_reason and `--tokens` completion tokens, its text must begin
with what it had before the seam, and (the simulated engine's answers being a function of the
request) be its undisturbed answer word for word; a run that breaks any of these says so and exits 1.
Printed per run and over all runs: the moved streams, the seam gap p50/p99, the token gap p50/p99.

`--per-piece`: what resuming costs a stream that never breaks, in the gateway's own process: the CPU
time per piece of the plain stream body (gateway.upstream.stream.StreamBody) and of the resuming one
(gateway.http.resume.ResumingBody) over the same in-memory answer of `--tokens` vLLM-shaped events
(the rewrite of the model's name included in both), best of 7 alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests


PROMPTS = ("Write a long story about a lighthouse keeper and the sea.",
           "Describe, step by step, how bread is baked in a village bakery.")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


class Stream:
    """One client stream: when each content event came, the text, the end."""

    def __init__(self, i: int, url: str, tokens: int):
        self.i, self.url, self.tokens = i, url, tokens
        self.times: list[float] = []
        self.pieces: list[str] = []
        self.finish: str | None = None
        self.usage: dict | None = None
        self.endpoint = ""
        self.error: str | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def body(self) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": PROMPTS[self.i % 2]}],
                "max_tokens": self.tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    def run(self) -> None:
        try:
            with requests.post(self.url + "/v1/chat/completions", json=self.body(), stream=True, timeout=300) as r:
                self.endpoint = r.headers.get("X-LLMGW-Endpoint", "")
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.text[:200]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith(b"data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        self.error = ev["error"]["message"]
                        return
                    if ev.get("usage"):
                        self.usage = ev["usage"]
                    for c in ev.get("choices") or ():
                        if c["delta"].get("content"):
                            self.times.append(time.monotonic())
                            self.pieces.append(c["delta"]["content"])
                        self.finish = c.get("finish_reason") or self.finish
        except Exception as e:  # noqa: BLE001 - reported as the stream's failure
            self.error = f"{type(e).__name__}: {e}"

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def start_engines(cluster, engine: str, slots: int, workdir: Path):
    """Two engines; returns [(name, url, proc)]."""
    from harness.procs import free_port, python, wait_until

    out = []
    for name in ("e1", "e2"):
        port = free_port()
        if engine == "sim":
            argv = [python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m", "--step-ms", "25",
                    "--max-seqs", str(slots)]
            proc = cluster.procs.start(name, argv)
        else:
            from llmgw.engines.selfcheck import launch_spec

            spec = launch_spec(None, None, port, os.environ, ("-t", "1", "-tb", "1", "-np", str(slots),
                                                              "-c", str(slots * 512), "-a", "m"))
            proc = cluster.procs.start(name, list(spec.argv), env=dict(spec.env))
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 120, what=f"{name} ready")
        out.append((name, url, proc))
    return out


def one_run(a, run: int) -> dict:
    from llmgw import surface
    from llmgw.state.records import EndpointInfo
    from harness.cluster import Cluster
    from harness.procs import wait_until

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-resume-"))
    cluster = Cluster(workdir)
    try:
        cluster.start_redis()
        engines = start_engines(cluster, a.engine, a.streams, workdir)
        kind = "sim" if a.engine == "sim" else "llamacpp"
        eps = [EndpointInfo(id=n, url=u, models=("m",), engine=kind, model="m", served_name="m", capacity=a.streams,
                            paths=surface.same_paths(surface.CHAT, surface.COMPLETIONS)) for n, u, _ in engines]
        undisturbed = {}
        if a.engine == "sim":  # the answer each prompt gets, straight from an engine
            for p in range(2):
                body = {**Stream(p, "", a.tokens).body(), "stream": False}
                undisturbed[p] = requests.post(engines[1][1] + "/v1/chat/completions", json=body,
                                               timeout=60).json()["choices"][0]["message"]["content"]
        cluster.store().write_endpoints(eps, f"bench-{run}", time.time())
        gw = cluster.start_gateway(LLMGW_GATEWAY_STALL_TIMEOUT="10")
        wait_until(lambda: requests.get(gw + "/readyz", timeout=1).ok, 30, what="gateway ready")
        streams = [Stream(i, gw, a.tokens) for i in range(a.streams)]
        for s in streams:
            s.thread.start()
        wait_until(lambda: all(len(s.times) >= a.kill_at or s.error for s in streams), 120,
                   what=f"{a.kill_at} tokens on every stream")
        counts = {n: sum(s.endpoint == n for s in streams) for n, _, _ in engines}
        victim = max(engines, key=lambda e: counts[e[0]])
        killed_at = time.monotonic()
        os.kill(victim[2].pid, signal.SIGKILL)
        for s in streams:
            s.thread.join(300)
        problems, seams, gaps, moved = [], [], [], 0
        for s in streams:
            if s.error or s.finish is None:
                problems.append(f"stream {s.i}: {s.error or 'no finish_reason'}")
                continue
            done = (s.usage or {}).get("completion_tokens")
            if done != a.tokens:
                problems.append(f"stream {s.i}: {done} completion tokens, asked for {a.tokens}")
            if a.engine == "sim" and s.text != undisturbed[s.i % 2]:
                problems.append(f"stream {s.i}: its text differs from the undisturbed answer")
            before = [t for t in s.times if t < killed_at]
            after = [t for t in s.times if t >= killed_at]
            if s.endpoint == victim[0] and before and after:
                moved += 1
                seams.append(after[0] - before[-1])
            gaps += [b - a_ for a_, b in zip(s.times, s.times[1:]) if not (a_ < killed_at <= b)]
        return {"moved": moved, "streams": len(streams), "seams": seams, "gaps": gaps, "problems": problems}
    finally:
        for p in cluster.procs.procs:
            p.signal_group(signal.SIGCONT)
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def per_piece(tokens: int) -> None:
    from types import SimpleNamespace

    from gateway.http.attempt import Hop
    from gateway.http.resume import ResumingBody
    from gateway.request.call import Call, EngineRequest
    from gateway.request.surface import ROUTES
    from gateway.upstream.rewrite import AnswerRewrite
    from gateway.upstream.stream import StreamBody

    def event(delta: str, finish=None) -> bytes:
        return b"data: " + json.dumps({
            "id": "chatcmpl-5c1a2b3c4d5e6f708192a3b4c5d6e7f8", "object": "chat.completion.chunk", "created": 1764921600,
            "model": "m", "choices": [{"index": 0, "delta": {"content": delta}, "logprobs": None,
                                       "finish_reason": finish}]}, separators=(",", ":")).encode() + b"\n\n"

    pieces = [event(" the") for _ in range(tokens - 1)] + [event(" end", "length") + b"data: [DONE]\n\n"]

    class Resp:  # an engine's answer already received: only the body's own work is timed
        content_type = "text/event-stream"
        status = 200

        def chunks(self):
            return iter(pieces)

        def release(self):
            pass

        close = release

        def idle_timeout(self, seconds):
            pass

    class Lease:
        class choice:  # noqa: N801 - the shape Lease has
            class endpoint:  # noqa: N801
                id = "e1"

        def release(self, *a):
            pass

    # The proxied request, as far as a stream that never breaks reads it.
    ex = SimpleNamespace(call=Call(ROUTES["chat"], "m", body={}), rid="r")

    def noop(*a):
        pass

    def plain():
        return StreamBody(Resp(), float("inf"), noop, noop, rewrite=AnswerRewrite("m"))

    def resuming():
        hop = Hop(Lease(), Resp(), EngineRequest("", None, None, None), 0.0)
        return ResumingBody(hop, ex, 30.0, float("inf"), noop, noop, time.monotonic, noop, "m")

    best = {"plain": float("inf"), "resuming": float("inf")}
    for _ in range(7):
        for name, make in (("plain", plain), ("resuming", resuming)):
            t = time.process_time()
            for _ in range(20):
                body = make()
                for _ in body:
                    pass
                body.close()
            best[name] = min(best[name], (time.process_time() - t) / (20 * tokens))
    print(f"per piece, best of 7 ({tokens} events per stream): StreamBody {best['plain'] * 1e6:.2f} us, "
          f"ResumingBody {best['resuming'] * 1e6:.2f} us (+{(best['resuming'] - best['plain']) * 1e6:.2f} us)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sim", "llamacpp"), default="sim")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--kill-at", type=int, default=20, help="tokens every stream has when the engine is killed")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--per-piece", action="store_true", help="the CPU per piece of a stream that never breaks")
    a = ap.parse_args()
    if a.per_piece:
        per_piece(a.tokens)
        return
    print(f"resume: {os.cpu_count()} cores; engine {a.engine}; {a.streams} streams of {a.tokens} tokens, "
          f"kill -9 of the busier of 2 engines at {a.kill_at} tokens; gaps in ms")
    print(f"{'run':>4} {'moved':>9} {'seam p50':>9} {'seam p99':>9} {'token p50':>10} {'token p99':>10}")
    seams, gaps, failed = [], [], False
    for run in range(1, a.runs + 1):
        r = one_run(a, run)
        seams += r["seams"]
        gaps += r["gaps"]
        print(f"{run:>4} {r['moved']:>4}/{r['streams']:<4} {pct(r['seams'], .5) * 1e3:>9.0f} "
              f"{pct(r['seams'], .99) * 1e3:>9.0f} {pct(r['gaps'], .5) * 1e3:>10.1f} {pct(r['gaps'], .99) * 1e3:>10.1f}",
              flush=True)
        for p in r["problems"]:
            print(f"     FAILED {p}")
            failed = True
    print(f" all {len(seams):>9} {pct(seams, .5) * 1e3:>9.0f} {pct(seams, .99) * 1e3:>9.0f} "
          f"{pct(gaps, .5) * 1e3:>10.1f} {pct(gaps, .99) * 1e3:>10.1f}"
          + (f"   (seam mean {statistics.mean(seams) * 1e3:.0f})" if seams else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
