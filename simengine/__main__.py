"""Command line of the simulated engine. Keep it stable: flags are only ever added."""

from __future__ import annotations

import signal
import sys
import threading
import time

from simengine import multinode
from simengine.cli import kv_events, lora_options, multinode_problems, parser
from simengine.core import SimConfig
from simengine.server import ServerOptions, build_server, log


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    for problem in multinode_problems(args.nnodes, args.node_rank, args.headless):
        p.error(problem)
    names = tuple(args.served_model_name)
    if args.headless:
        log(f"starting: rank {args.node_rank} of {args.nnodes} (headless), joining "
            f"{args.master_addr}:{args.master_port}")
    else:
        log(f"starting: models {', '.join(names)} on {args.host}:{args.port}"
            + (" (API key required on /v1)" if args.api_key else ""))
    if args.fail_start:
        log("failing at start as asked (--fail-start)")
        return 1
    opts = ServerOptions(
        host=args.host, port=args.port, names=names,
        core=SimConfig(max_seqs=args.max_seqs, kv_tokens=args.kv_tokens, step_ms=args.step_ms,
                       batch_alpha=args.batch_alpha, prefill_ms_per_token=args.prefill_ms_per_token,
                       speed=args.speed, slow_to=args.slow_to, slow_after=args.slow_after,
                       max_loras=args.max_loras if args.enable_lora else 0,
                       policy=args.scheduling_policy if args.metrics_style == "vllm" else "fcfs"),
        max_tokens_default=args.max_tokens_default, metrics_style=args.metrics_style, seed=args.seed,
        crash_after=args.crash_after, hang_after=args.hang_after, slow_start=args.slow_start, error_rate=args.error_rate,
        log_requests=args.log_requests, api_key=args.api_key, log_headers=args.log_headers,
        stream_start=args.stream_start, prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
        slot_similarity=args.slot_prompt_similarity, cache_ram_mib=args.cache_ram,
        kv_bytes_per_token=args.kv_bytes_per_token, kv_events=kv_events(args),
        lora=lora_options(args), answer_model=args.answer_model, close_early=args.close_early,
    )
    if opts.kv_events is not None and (opts.metrics_style != "vllm" or not opts.prefix_caching):
        p.error("KV events come from vLLM's prefix cache: they need --metrics-style vllm and prefix caching on")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.startup_delay and stop.wait(args.startup_delay):
        log("stopped during startup delay")
        return 0
    if args.headless:
        # A member serves nothing itself: it lives as long as its connection to the head.
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        return multinode.join(args.master_addr, args.master_port, args.node_rank, args.join_timeout, stop, log)
    rendezvous = None
    if args.nnodes > 1:
        try:
            rendezvous = multinode.Rendezvous(args.host, args.master_port, args.nnodes, log)
        except OSError as e:
            log(f"cannot listen for members on {args.host}:{args.master_port}: {e.strerror or e}")
            return 1
        log(f"head of {args.nnodes} nodes: members join on port {rendezvous.port}")
    publisher = None
    if opts.kv_events is not None:
        try:
            from simengine.kvevents import Publisher

            publisher = Publisher(opts.kv_events, opts.block_size, log)
        except ImportError as e:
            log(f"KV events need pyzmq and msgpack ({e.name} is missing): pip install pyzmq msgpack")
            return 1
        except OSError as e:
            log(str(e))
            return 1
        log(f"publishing KV events on {opts.kv_events.endpoint}"
            + (f", replay on {opts.kv_events.replay_endpoint}" if opts.kv_events.replay_endpoint else ""))
    try:
        server, app = build_server(opts, publisher.publish if publisher else None)
    except OSError as e:
        log(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
        if rendezvous is not None:
            rendezvous.close()
        if publisher is not None:
            publisher.close()
        return 1
    app.rendezvous = rendezvous
    app.started = time.monotonic()
    app.engine.start()

    def on_signal(signum, _frame):
        log(f"received signal {signum}, shutting down")
        # shutdown() waits for serve_forever, which runs in this (main) thread: call it elsewhere.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log(f"ready on http://{args.host}:{server.server_address[1]} (max-seqs {args.max_seqs}, "
        f"metrics {args.metrics_style})")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        app.engine.stop()
        server.server_close()
        if publisher is not None:
            publisher.close()
        if rendezvous is not None:
            rendezvous.close()
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
