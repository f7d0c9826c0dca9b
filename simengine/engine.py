"""The simulated engine's process state: the batching model on the real clock, and what the HTTP
handlers share (options, fault injection, the Responses store).

One daemon thread drives `SimCore` (plan a step, sleep until its end, deliver one token to each
sequence in the batch); each HTTP request thread submits its sequence and reads its tokens from a
queue. KV events, when enabled, are handed to the publisher after every step.
"""

from __future__ import annotations

import os
import queue
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from simengine import responses as rapi
from simengine import tokens as tok
from simengine.core import Emit, SimConfig, SimCore
from simengine.lora import Adapters, LoraInfo, LoraOptions
from simengine.metrics import MetricsState, Snapshot, render_llamacpp, render_vllm
from simengine.prefix import PrefixCache
from simengine.slots import Slots


@dataclass(frozen=True)
class ServerOptions:
    host: str
    port: int
    names: tuple[str, ...]
    core: SimConfig = field(default_factory=SimConfig)
    max_tokens_default: int = 16
    metrics_style: str = "vllm"  # or "llamacpp": also the engine whose caching and timing it models
    seed: int = 0
    crash_after: int | None = None
    hang_after: int | None = None
    slow_start: float = 0.0
    error_rate: float = 0.0
    log_requests: bool = False
    api_key: str | None = field(default=None, repr=False)
    log_headers: bool = False
    stream_start: str | None = None  # None: the personality's own (metrics_style)
    prefix_caching: bool = True  # vLLM's automatic prefix caching; llama.cpp's cache_prompt
    block_size: int = 16
    slot_similarity: float = 0.1
    cache_ram_mib: int = 8192  # llama.cpp's host-memory prompt cache (-cram; 0: none)
    kv_bytes_per_token: int = 131072  # what a token's KV takes there: an 8B model's in f16 (Llama 3 8B)
    kv_events: Any = None  # simengine.kvevents.KvEventsConfig, or None
    lora: LoraOptions | None = None  # --enable-lora
    answer_model: str | None = None  # the `model` every completion names, whatever was asked (llama-server's alias)
    # A fault: every stream ends after this many tokens, its HTTP body closed cleanly but without the
    # answer's end (no finish_reason, no [DONE], no response.completed), as an engine that gives up.
    close_early: int | None = None

    @property
    def start(self) -> str:
        return self.stream_start or self.metrics_style


def prompt_cache_tokens(opts: ServerOptions) -> int:
    """llama-server's prompt cache limit in tokens: its --cache-ram over a token's KV bytes, never
    fewer than the context (as `server_prompt_cache::update` grows its token limit); 0: none."""
    if opts.cache_ram_mib < 0:  # -1: no limit
        return 1 << 62
    if opts.cache_ram_mib == 0:
        return 0
    return max(opts.core.kv_tokens, opts.cache_ram_mib * (1 << 20) // max(1, opts.kv_bytes_per_token))


def log(msg: str) -> None:
    print(f"simengine: {msg}", file=sys.stderr, flush=True)


class Engine:
    """Runs the batching model on the real clock in a daemon thread."""

    def __init__(self, config: SimConfig, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, prefix: PrefixCache | None = None,
                 slots: Slots | None = None, publish: Callable[[list], None] | None = None,
                 lora_info: LoraInfo | None = None, block_size: int = 16):
        self.core = SimCore(config, prefix=prefix, slots=slots)
        self.lora_info = lora_info
        self.block_size = block_size  # vLLM's --block-size, which its cache_config_info reports
        self.stats = MetricsState(started=time.time())
        self._clock, self._sleep, self._publish = clock, sleep, publish
        self._cond = threading.Condition()
        self._queues: dict[str, queue.SimpleQueue[Emit]] = {}
        self._stopping = False
        self._frozen = False
        self._thread = threading.Thread(target=self._run, name="sim-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def freeze(self) -> None:
        """Stop making progress for good, while HTTP stays up (a hung EngineCore)."""
        with self._cond:
            self._frozen = True
            self._cond.notify_all()

    def submit(self, prompt_tokens: int, max_tokens: int, tokens: list[int] | None = None,
               output: list[int] | None = None, salt: str | None = None,
               adapter: str | None = None, priority: int = 0) -> tuple[str, queue.SimpleQueue[Emit]]:
        rid = uuid.uuid4().hex
        q: queue.SimpleQueue[Emit] = queue.SimpleQueue()
        with self._cond:
            self.core.submit(rid, prompt_tokens, max_tokens, self._clock(), tokens=tokens, output=output, salt=salt,
                             adapter=adapter, priority=priority)
            self._queues[rid] = q
            self._cond.notify_all()
        return rid, q

    def cancel(self, rid: str) -> None:
        with self._cond:
            self.core.cancel(rid)
            self._queues.pop(rid, None)
            # Not a success: vLLM 0.32 counts a request its client aborted under no finished_reason
            # (seen on its CPU build: request_success_total{finished_reason="abort"} stayed 0).
            self._flush_events()

    def finished(self, reason: str) -> None:
        with self._cond:
            self.stats.success[reason] = self.stats.success.get(reason, 0) + 1

    def pooled(self, prompt_tokens: int) -> None:
        """A request that reads its prompt and generates nothing (rerank, score, transcription)
        counts its prompt tokens and one success, as vLLM's pooling requests do."""
        with self._cond:
            self.core.prompt_tokens_total += prompt_tokens
            self.stats.success["stop"] = self.stats.success.get("stop", 0) + 1

    def snapshot(self) -> Snapshot:
        with self._cond:
            s, c = self.stats, self.core
            return Snapshot(
                running=c.num_running, waiting=c.num_waiting, kv_usage=c.kv_usage,
                prompt_tokens_total=c.prompt_tokens_total, generation_tokens_total=c.generation_tokens_total,
                success_total=dict(s.success), ttft=s.ttft.copy(), e2e=s.e2e.copy(), started=s.started,
                busy_seconds_prompt=s.busy_prompt, busy_seconds_decode=s.busy_decode, n_decode_total=s.n_decode,
                max_seq_tokens=c.max_seq_tokens, prompt_cached_total=c.prompt_cached_total,
                prefix_queries=c.prefix.queries if c.prefix else 0, prefix_hits=c.prefix.hits if c.prefix else 0,
                lora_info=tuple(self.lora_info.observe(c.lora_running, c.lora_waiting, time.time()))
                if self.lora_info else (),
                kv_tokens=c.config.kv_tokens, block_size=self.block_size, prefix_caching=c.prefix is not None,
            )

    def _flush_events(self) -> None:
        if self.core.prefix is not None:
            events = self.core.prefix.take_events()
            if events and self._publish is not None:
                self._publish(events)

    def _run(self) -> None:
        deadline = self._clock()
        while True:
            with self._cond:
                step = None
                while not self._stopping:
                    if not self._frozen:
                        step = self.core.plan_step(self._clock())
                        if step is not None:
                            break
                    self._cond.wait()
                    deadline = self._clock()  # idle time does not count against the next step
                if self._stopping or step is None:
                    return
            # Sleep to an absolute deadline so per-step oversleep does not slow the token rate.
            deadline = max(deadline, self._clock() - 0.05) + step.duration
            delay = deadline - self._clock()
            if delay > 0:
                self._sleep(delay)
            with self._cond:
                emits = self.core.finish_step(step, self._clock())
                self.stats.busy_decode += step.decode
                self.stats.busy_prompt += max(0.0, step.duration - step.decode)  # the step's prefill share
                self.stats.n_decode += 1
                deliveries = []
                for e in emits:
                    if e.ttft is not None:
                        self.stats.ttft.observe(e.ttft)
                    if e.e2e is not None:
                        self.stats.e2e.observe(e.e2e)
                    q = self._queues.pop(e.rid, None) if e.done else self._queues.get(e.rid)
                    if q is not None:
                        deliveries.append((q, e))
                self._flush_events()
            for q, e in deliveries:
                q.put(e)


class SimApp:
    """Per-process state shared by the request handlers (built once in main, no globals)."""

    def __init__(self, opts: ServerOptions, publish: Callable[[list], None] | None = None):
        self.opts = opts
        llamacpp = opts.metrics_style == "llamacpp"
        prefix = PrefixCache(opts.block_size) if opts.prefix_caching and not llamacpp else None
        slots = Slots(opts.core.max_seqs, opts.slot_similarity, cache_tokens=prompt_cache_tokens(opts)) if (
            opts.prefix_caching and llamacpp) else None
        lora = opts.lora
        self.engine = Engine(opts.core, prefix=prefix, slots=slots, publish=publish,
                             lora_info=LoraInfo(lora.max_loras) if lora else None, block_size=opts.block_size)
        self.adapters = Adapters(lora) if lora else None  # the LoRA adapters it holds
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._rng = random.Random(opts.seed)
        self._requests = 0
        self._answered = 0
        # Which replica answered, in a field every OpenAI client and proxy passes through.
        self.fingerprint = f"llmgw-sim-{opts.port}"
        # A multi-node head's rendezvous (simengine.multinode.Rendezvous); None on one node.
        self.rendezvous: Any = None
        self.responses = rapi.Store()  # what GET/DELETE /v1/responses/{id} and previous_response_id read

    def loading(self) -> bool:
        return self.loading_reason() is not None

    def loading_reason(self) -> str | None:
        """Why the engine cannot serve yet (503), or None once it can."""
        if time.monotonic() - self.started < self.opts.slow_start:
            return "Loading model"
        if self.rendezvous is not None and not self.rendezvous.ready():
            ranks = ", ".join(map(str, self.rendezvous.waiting_for()))
            return f"Waiting for node rank(s) {ranks} of {self.rendezvous.nnodes} to join"
        return None

    def next_request(self) -> tuple[int, bool]:
        """The request's sequence number and whether it should fail (seeded, in arrival order)."""
        with self._lock:
            self._requests += 1
            fail = self.opts.error_rate > 0 and self._rng.random() < self.opts.error_rate
            return self._requests, fail

    def answered(self) -> None:
        with self._lock:
            self._answered += 1
            crash = self.opts.crash_after is not None and self._answered >= self.opts.crash_after
            hang = self.opts.hang_after is not None and self._answered == self.opts.hang_after
        if hang:
            log(f"hanging after {self._answered} requests (--hang-after): HTTP stays up, no tokens")
            self.engine.freeze()
        if crash:
            log(f"crashing after {self._answered} requests (--crash-after)")
            os._exit(1)

    def served(self) -> tuple[str, ...]:
        """What a request may name: the model's names, then the adapters loaded now."""
        return self.opts.names + (self.adapters.names() if self.adapters else ())

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request for `model` runs with (None: the base model)."""
        return model if self.adapters is not None and model not in self.opts.names else None

    def answer(self, context: bytes, n: int, adapter: str | None = None, continued: bool = False) -> list[str]:
        """The words of the answer that follows `context` (the prompt's text), one token each: the
        same for the same request on every replica with the same --seed, as a real model's at
        temperature 0 (simengine.tokens.answer_after). An adapter's answer starts with its name in
        brackets, so a test can tell which adapter served it."""
        return tok.answer_after(context, n, continued, f"{self.opts.seed}:{adapter or ''}",
                                f"[{adapter}] " if adapter else "")

    def metrics_text(self) -> str:
        snap = self.engine.snapshot()
        if self.opts.metrics_style == "llamacpp":
            return render_llamacpp(snap)
        return render_vllm(snap, self.opts.names[0])
