"""The simulated engine's command-line options, shared by `__main__` and the sim engine driver (which
checks a profile's args against them when the catalog is applied). Only ever add flags."""

from __future__ import annotations

import argparse
import dataclasses
import os

from simengine.core import POLICIES
from simengine.sse import STREAM_STARTS
from simengine.kvevents import LAYOUTS, KvEventsConfig, parse_config
from simengine.lora import LoraOptions, runtime_allowed


def _number(text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def _fraction(text: str) -> float:
    v = _number(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return v


def _slow_fraction(text: str) -> float:
    v = _number(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError("must be above 0 and at most 1")
    return v


def _positive_int(text: str) -> int:
    v = _number(text, int)
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def _non_negative_int(text: str) -> int:
    v = _number(text, int)
    if v < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return v


def _port(text: str) -> int:
    v = _number(text, int)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError("must be a port number (0-65535)")
    return v


def _non_negative(text: str) -> float:
    v = _number(text)
    if v < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return v


def _positive(text: str) -> float:
    v = _number(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return v


def _kv_events_config(text: str) -> KvEventsConfig:
    try:
        return parse_config(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_events(args: argparse.Namespace) -> KvEventsConfig | None:
    """The KV events configuration the flags ask for (--kv-events-config, then the shorthands over it)."""
    cfg = args.kv_events_config
    if args.kv_events_endpoint:
        cfg = dataclasses.replace(cfg or KvEventsConfig(), enable_kv_cache_events=True, endpoint=args.kv_events_endpoint)
    if cfg is None:
        return None
    for name in ("replay_endpoint", "topic", "layout"):
        value = getattr(args, "kv_events_" + name)
        if value is not None:
            cfg = dataclasses.replace(cfg, **{name: value})
    return cfg if cfg.enabled else None


def lora_options(args: argparse.Namespace) -> LoraOptions | None:
    """The LoRA options the flags ask for (None without --enable-lora); runtime loading as vLLM's, by
    its environment variable."""
    if not args.enable_lora:
        return None
    return LoraOptions(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                       load_time=args.lora_load_time, runtime=runtime_allowed(os.environ))


def parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simengine", exit_on_error=exit_on_error,
                                description="A simulated OpenAI-compatible LLM engine (vLLM-like metrics).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=["sim"], metavar="NAME",
                   help="the model name, then any aliases (all answer)")
    p.add_argument("--model", default="", help="ignored; accepted so the command looks like a real engine's")
    p.add_argument("--answer-model", default=None, metavar="NAME",
                   help="the `model` completions and responses name, whatever the request asked for "
                        "(llama-server answers with its first alias, or 'default')")
    p.add_argument("--api-key", default=os.environ.get("SIMENGINE_API_KEY") or None, metavar="KEY",
                   help="refuse /v1 requests without 'Authorization: Bearer KEY' (401), like vLLM's --api-key; "
                        "/health and /metrics stay open (default: $SIMENGINE_API_KEY)")
    g = p.add_argument_group("load model")
    g.add_argument("--max-seqs", type=_positive_int, default=16, help="sequences running at once; the rest wait")
    g.add_argument("--kv-tokens", type=_positive_int, default=65536, help="KV budget in tokens")
    g.add_argument("--step-ms", type=_non_negative, default=20.0, help="decode step with a batch of one (ms)")
    g.add_argument("--batch-alpha", type=_non_negative, default=0.08,
                   help="each extra running sequence makes a step this fraction slower")
    g.add_argument("--prefill-ms-per-token", type=_non_negative, default=0.25)
    g.add_argument("--speed", type=_positive, default=1.0, help="divides every duration (2 = twice as fast)")
    g.add_argument("--slow-to", type=_slow_fraction, default=1.0,
                   help="after --slow-after seconds, run at this fraction of --speed (0.3 = 30 %%)")
    g.add_argument("--slow-after", type=_non_negative, default=0.0,
                   help="seconds after the first completion request arrived when --slow-to takes effect")
    g.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                   help="vLLM's: fcfs (arrival order) or priority (each request's `priority`, lower first, then "
                        "arrival); a --metrics-style llamacpp engine has no priority and keeps fcfs")
    g.add_argument("--max-tokens-default", type=_positive_int, default=16,
                   help="output length when a request sets no max_tokens")
    g.add_argument("--metrics-style", choices=("vllm", "llamacpp"), default="vllm",
                   help="the engine it stands for: its /metrics names, its cache (vLLM's prefix cache or "
                        "llama.cpp's slots) and when a stream's first bytes leave")
    c = p.add_argument_group("prefix caching and stream timing (see simengine/prefix.py, simengine/slots.py)")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's automatic prefix caching, or llama.cpp's cache_prompt in its slots (default on)")
    c.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (vLLM's)")
    c.add_argument("-sps", "--slot-prompt-similarity", type=_fraction, default=0.1,
                   help="llama.cpp: a slot whose prompt shares more than this fraction is reused")
    c.add_argument("-cram", "--cache-ram", type=int, default=8192,
                   help="llama.cpp: MiB of its host-memory prompt cache, which keeps the prompts slots gave "
                        "up (default 8192, as llama-server's; -1: no limit; 0: none, each slot keeps only its last prompt)")
    c.add_argument("--kv-bytes-per-token", type=_positive_int, default=131072,
                   help="llama.cpp: KV bytes one token takes in that cache (default: an 8B model's in f16)")
    c.add_argument("--stream-start", choices=STREAM_STARTS, default=None,
                   help="when a stream's response head and role chunk leave: vllm (head at once, role chunk "
                        "with the first token), llamacpp (all with the first token), early (head and role chunk "
                        "at once); default: the --metrics-style engine's")
    k = p.add_argument_group("KV cache events (vLLM's, over ZMQ; needs pyzmq and msgpack)")
    k.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help='vLLM\'s: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000}')
    k.add_argument("--kv-events-endpoint", default=None, metavar="URL",
                   help="shorthand: enable KV events on this PUB endpoint (bound when it has *, else connected)")
    k.add_argument("--kv-events-replay-endpoint", default=None, metavar="URL", help="the replay ROUTER (bound)")
    k.add_argument("--kv-events-topic", default=None)
    k.add_argument("--kv-events-layout", choices=LAYOUTS, default=None,
                   help="map (vLLM's current event layout, default) or array (earlier releases)")
    lo = p.add_argument_group("LoRA adapters (like vLLM's; see simengine/lora.py)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters; with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true they are loaded and "
                         "unloaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)")
    lo.add_argument("--max-loras", type=_positive_int, default=1, help="distinct adapters in one batch")
    lo.add_argument("--max-lora-rank", type=_positive_int, default=16, help="the largest adapter rank it loads")
    lo.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                    help="adapters it holds loaded at most (default: --max-loras)")
    lo.add_argument("--lora-load-time", type=_non_negative, default=0.0, help="seconds one adapter load takes")
    f = p.add_argument_group("fault injection")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--fail-start", action="store_true", help="log a line and exit 1 at start")
    f.add_argument("--startup-delay", type=_non_negative, default=0.0,
                   help="seconds before the port opens (connection refused meanwhile, like vLLM loading)")
    f.add_argument("--slow-start", type=_non_negative, default=0.0,
                   help="seconds /health answers 503 after the port opens (like llama.cpp loading)")
    f.add_argument("--crash-after", type=_positive_int, default=None,
                   help="exit hard (status 1) once N completion requests were answered")
    f.add_argument("--hang-after", type=_positive_int, default=None,
                   help="once N completion requests were answered, stop producing tokens while /health "
                        "stays 200 and /metrics goes stale (a hung engine core)")
    f.add_argument("--close-early", type=_positive_int, default=None, metavar="TOKENS",
                   help="end every stream after this many tokens, cleanly at the HTTP level but without the answer's "
                        "end (no finish_reason, no [DONE]): an engine that gives up mid-answer")
    f.add_argument("--error-rate", type=_fraction, default=0.0,
                   help="this fraction of completion requests answers 500 (seeded)")
    f.add_argument("--log-requests", action="store_true")
    f.add_argument("--log-headers", action="store_true",
                   help="log every request's headers (tests: what a proxy forwards); an Authorization value "
                        "is logged as the SHA-256 of its token, never the token")
    m = p.add_argument_group("multi-node (like vLLM's; see simengine/multinode.py)")
    m.add_argument("--nnodes", type=_positive_int, default=1, help="nodes this replica spans")
    m.add_argument("--node-rank", type=_non_negative_int, default=0, help="0 = the head (serves HTTP)")
    m.add_argument("--master-addr", default="127.0.0.1", help="the head's address, which members join")
    m.add_argument("--master-port", type=_port, default=29500,
                   help="the head listens here for its members when --nnodes > 1")
    m.add_argument("--headless", action="store_true", help="a member (rank > 0): no HTTP, joins the head")
    m.add_argument("--join-timeout", type=_positive, default=30.0,
                   help="seconds a headless member tries to join the head before exiting 1")
    return p


def multinode_problems(nnodes: int, node_rank: int, headless: bool) -> list[str]:
    """Inconsistent multi-node flags (argparse checks each alone; these rules span them)."""
    if node_rank >= nnodes:
        return [f"--node-rank {node_rank} must be below --nnodes {nnodes}"]
    if headless and node_rank == 0:
        return ["--headless is for members (--node-rank 1 and up); rank 0 is the head and serves HTTP"]
    if node_rank > 0 and not headless:
        return [f"--node-rank {node_rank} is a member: add --headless (only rank 0 serves HTTP)"]
    return []


def check_args(args: list[str]) -> list[str]:
    """Problems with a profile's extra simengine args (unknown flag, bad value), without exiting."""
    problems: list[str] = []
    p = parser(exit_on_error=False)
    # argparse reports some errors through error(), which exits: turn that into a problem too.
    def fail(message: str) -> None:
        raise argparse.ArgumentError(None, message)

    p.error = fail  # type: ignore[method-assign]
    try:
        _, extra = p.parse_known_args(list(args))
    except argparse.ArgumentError as e:
        return problems + [str(e)]
    if extra:
        problems.append(f"unknown simengine option(s): {' '.join(extra)}")
    return problems
