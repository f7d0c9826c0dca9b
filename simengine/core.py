"""The simulated engine's batching model: pure, clock-free, unit-tested with a virtual clock.

It models what makes a real engine's load numbers move: continuous batching of up to `max_seqs`
running sequences (the rest wait, FIFO; under vLLM's `priority` policy in order of each request's
`priority`, lower first, then of arrival), a decode step that gets slower as the batch grows, prefill
time proportional to the prompt, and a KV-cache budget in tokens. A request that comes with its
tokens may find part of its prompt already computed, and skips that part of the prefill: in vLLM's
prefix cache (simengine.prefix: blocks shared with running sequences within the KV budget) or in
llama.cpp's slots (simengine.slots: each keeps its last prompt). The HTTP server drives it with the
real clock (plan a step, sleep its duration, finish it); tests drive it with `simulate()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from simengine.prefix import PrefixCache, chain
from simengine.slots import Slot, Slots


POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the model. Times are in milliseconds at speed 1.0."""

    max_seqs: int = 16
    kv_tokens: int = 65536  # KV budget: prompt + generated tokens held by running sequences
    step_ms: float = 20.0  # one decode step with a batch of one (20 ms = 50 tokens/s per stream)
    batch_alpha: float = 0.08  # each extra sequence in the batch adds this fraction to a step
    prefill_ms_per_token: float = 0.25
    speed: float = 1.0  # >1 is faster: every duration is divided by it
    # A degrading engine (thermal throttling, a noisy neighbour): `slow_after` seconds after its first
    # request arrived, every duration is divided by `slow_to` as well (0.3 = 30 % of its speed).
    slow_to: float = 1.0
    slow_after: float = 0.0
    # LoRA: at most this many distinct adapters in the running batch (vLLM's max_loras; 0: no limit).
    max_loras: int = 0
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (a request's `priority`, lower
    # first, then arrival: vLLM's waiting queue under that policy).
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_seqs < 1:
            raise ValueError("max_seqs must be at least 1")
        if self.kv_tokens < 1:
            raise ValueError("kv_tokens must be at least 1")
        if self.speed <= 0:
            raise ValueError("speed must be positive")
        if not 0 < self.slow_to <= 1 or self.slow_after < 0:
            raise ValueError("slow_to must be within (0, 1] and slow_after must not be negative")
        if self.step_ms < 0 or self.batch_alpha < 0 or self.prefill_ms_per_token < 0:
            raise ValueError("step_ms, batch_alpha and prefill_ms_per_token must not be negative")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")

    def decode_seconds(self, batch: int) -> float:
        """Duration of one decode step for `batch` running sequences."""
        return self.step_ms * (1.0 + self.batch_alpha * max(0, batch - 1)) / self.speed / 1000.0

    def prefill_seconds(self, prompt_tokens: int) -> float:
        return self.prefill_ms_per_token * prompt_tokens / self.speed / 1000.0


class RequestTooLarge(ValueError):
    """A request could never fit the KV budget, however long it waited."""


@dataclass
class _Seq:
    rid: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    generated: int = 0
    prefilled: bool = False
    tokens: list[int] | None = None  # the prompt's tokens, when known (then caches can match it)
    output: list[int] | None = None  # the answer's tokens, generated one per step
    salt: str | None = None
    cached: int = 0  # prompt tokens found computed at admission (their prefill is skipped)
    hashes: list[bytes] = field(default_factory=list)  # cached blocks this sequence references
    caching: bool = True  # false once a block of its chain was cached by another sequence first
    slot: Slot | None = None
    private: int = 0  # KV tokens reserved beyond the shared cached blocks it references
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    priority: int = 0  # vLLM's: lower is served first (only under the "priority" policy)

    @property
    def reserved(self) -> int:
        # Admission reserves the whole sequence, so a running sequence never has to be preempted.
        return self.prompt_tokens + self.max_tokens

    @property
    def held(self) -> int:
        return self.prompt_tokens + self.generated if self.prefilled else 0


@dataclass(frozen=True)
class Step:
    """One engine iteration: every sequence in `batch` gets one token after `duration` seconds."""

    duration: float
    batch: tuple[str, ...]
    prefill: tuple[str, ...]  # sequences whose prompt is processed in this step
    decode: float = 0.0  # the decode share of `duration` (the rest is prefill)


@dataclass(frozen=True)
class Emit:
    """One token produced for a request; `ttft` is set on its first token, `done` on its last."""

    rid: str
    index: int  # 0-based index of this token in the request's output
    done: bool
    ttft: float | None = None
    e2e: float | None = None
    cached: int | None = None  # on the first token: prompt tokens reused from a cache


@dataclass
class SimCore:
    config: SimConfig
    prefix: PrefixCache | None = None  # vLLM's prefix cache, or
    slots: Slots | None = None  # llama.cpp's slots (one of the two at most)
    waiting: deque[_Seq] = field(default_factory=deque)
    running: dict[str, _Seq] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    prompt_cached_total: int = 0  # of which found computed in a cache
    generation_tokens_total: int = 0
    requests_finished: int = 0
    max_seq_tokens: int = 0  # longest prompt + output seen (llama.cpp's n_tokens_max)
    first_arrival: float | None = None  # when the first request arrived (the slowdown counts from it)
    last_now: float = 0.0  # the latest step's end (a slot freed by a cancel counts as used then)

    def __post_init__(self) -> None:
        if self.prefix is not None and self.slots is not None:
            raise ValueError("an engine models either a prefix cache or slots, not both")
        if self.slots is not None and self.slots.n != self.config.max_seqs:
            raise ValueError("llama.cpp runs one sequence per slot: slots must equal max_seqs")

    # --- intake -----------------------------------------------------------------------------
    def submit(self, rid: str, prompt_tokens: int, max_tokens: int, now: float, tokens: list[int] | None = None,
               output: list[int] | None = None, salt: str | None = None, adapter: str | None = None,
               priority: int = 0) -> None:
        """Queue a request; `tokens` (its prompt) and `output` (its answer, `max_tokens` long) let the
        caches match it; `priority` places it in the waiting queue under the "priority" policy (behind
        every request of a lower or equal one, ahead of any of a higher). Raises RequestTooLarge if it
        could never fit the KV budget."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        need = max(1, prompt_tokens) + max_tokens
        if need > self.config.kv_tokens:
            raise RequestTooLarge(
                f"this request needs {need} tokens of KV cache (prompt {prompt_tokens} + max_tokens "
                f"{max_tokens}) but the engine holds at most {self.config.kv_tokens}"
            )
        if tokens is not None and len(tokens) != prompt_tokens:
            raise ValueError("tokens must hold the prompt's tokens")
        if output is not None and len(output) != max_tokens:
            raise ValueError("output must hold max_tokens tokens")
        if self.first_arrival is None:
            self.first_arrival = now
        seq = _Seq(rid, max(1, prompt_tokens), max_tokens, now, tokens=tokens, output=output, salt=salt,
                   adapter=adapter, priority=priority)
        if self.config.policy == "priority":
            at = next((i for i, s in enumerate(self.waiting) if s.priority > priority), len(self.waiting))
            self.waiting.insert(at, seq)
        else:
            self.waiting.append(seq)

    def cancel(self, rid: str) -> None:
        """Forget a request (client went away); frees its slot and KV at once."""
        seq = self.running.pop(rid, None)
        if seq is not None:
            self._leave(seq, self.last_now)
        for s in list(self.waiting):
            if s.rid == rid:
                self.waiting.remove(s)

    # --- the engine loop ----------------------------------------------------------------------
    def slowed(self, now: float | None) -> bool:
        """Whether the configured slowdown is in effect at `now` (never when the caller has no clock)."""
        c = self.config
        return (c.slow_to < 1 and now is not None and self.first_arrival is not None
                and now - self.first_arrival >= c.slow_after)

    def plan_step(self, now: float | None = None) -> Step | None:
        """Admit waiting requests (FIFO, while a slot and KV are free) and plan the next step, which
        starts at `now` (only the slowdown needs it). None when nothing is running. A request whose
        adapter would make more than `max_loras` distinct adapters in the batch is passed over (and
        keeps its place), as vLLM's scheduler does."""
        loras = {s.adapter for s in self.running.values() if s.adapter} if self.config.max_loras else set()
        skipped: list[_Seq] = []
        while self.waiting and len(self.running) < self.config.max_seqs:
            head = self.waiting[0]
            if self.config.max_loras and head.adapter and head.adapter not in loras \
                    and len(loras) >= self.config.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if not self._admit(head):
                break  # strict FIFO: the head waits for KV, nobody overtakes it
            self.waiting.popleft()
            self.running[head.rid] = head
            if head.adapter:
                loras.add(head.adapter)
        self.waiting.extendleft(reversed(skipped))
        if not self.running:
            return None
        prefill = tuple(s.rid for s in self.running.values() if not s.prefilled)
        stretch = 1.0 / self.config.slow_to if self.slowed(now) else 1.0
        decode = self.config.decode_seconds(len(self.running)) * stretch
        duration = decode + stretch * sum(
            self.config.prefill_seconds(self.running[r].prompt_tokens - self.running[r].cached) for r in prefill)
        return Step(duration=duration, batch=tuple(self.running), prefill=prefill, decode=decode)

    def _used(self) -> int:
        """KV tokens held for running sequences: their private reservations and the cached blocks
        they reference (unreferenced cached blocks are free space that still holds content)."""
        shared = (len(self.prefix.blocks) - len(self.prefix.free)) * self.prefix.block_size if self.prefix else 0
        return sum(s.private for s in self.running.values()) + shared

    def _admit(self, seq: _Seq) -> bool:
        """Whether `seq` fits now; if so, look it up in the cache and take its share of the budget."""
        hits: list[bytes] = []
        if self.prefix is not None and seq.tokens is not None:
            bs = self.prefix.block_size
            hashes = chain(seq.tokens, bs, seq.salt)
            hits = hashes[:self.prefix.match(hashes, seq.prompt_tokens)]
            need = seq.reserved - bs * len(hits) + bs * self.prefix.unreferenced(hits)
        else:
            need = seq.reserved
        if self._used() + need > self.config.kv_tokens:
            return False
        seq.private = seq.reserved
        if self.prefix is not None and seq.tokens is not None:
            self.prefix.record(seq.prompt_tokens, len(hits))
            self.prefix.acquire(hits)
            seq.hashes, seq.cached = hits, len(hits) * self.prefix.block_size
            seq.private -= seq.cached
            self.prefix.fit(self.config.kv_tokens - sum(s.private for s in self.running.values()) - seq.private)
            # vLLM caches a request's full blocks when it schedules them (KVCacheManager.allocate_slots
            # registers their hashes before the forward pass that computes them), so a request
            # admitted after it, in the same step or later, already finds them.
            self._cache_blocks(seq, seq.prompt_tokens)
        elif self.slots is not None and seq.tokens is not None:
            slot = self.slots.choose(seq.tokens)
            if slot is None:
                return False
            seq.slot, seq.cached = slot, self.slots.take(slot, seq.tokens)
        return True

    def _cache_blocks(self, seq: _Seq, done: int | None = None) -> None:
        """Cache the full blocks of what `seq` has computed, or is scheduled to compute (`done`
        tokens: its prompt at admission, then its answer so far)."""
        assert self.prefix is not None and seq.tokens is not None
        bs = self.prefix.block_size
        if done is None:
            done = seq.prompt_tokens + max(0, seq.generated - 1)  # the newest token has no KV yet
        if not seq.caching or done // bs <= len(seq.hashes):
            return
        computed = seq.tokens + (seq.output or [])[:max(0, seq.generated - 1)]
        start = seq.hashes[-1] if seq.hashes else None
        new = chain(computed[:done], bs, seq.salt, start=start, first=len(seq.hashes))
        first = len(seq.hashes) * bs
        added = self.prefix.insert(new, start, computed[first:first + len(new) * bs], seq.salt)
        seq.hashes += added
        seq.private -= len(added) * bs
        if len(added) < len(new):
            seq.caching = False

    def _leave(self, seq: _Seq, now: float) -> None:
        if self.prefix is not None:
            self.prefix.release(seq.hashes)
            seq.hashes = []
        if self.slots is not None and seq.slot is not None:
            self.slots.release(seq.slot, now)

    def finish_step(self, step: Step, now: float) -> list[Emit]:
        """Apply a planned step at time `now`: one token for each sequence still running."""
        self.last_now = now
        emits = []
        for rid in step.batch:
            seq = self.running.get(rid)
            if seq is None:  # cancelled during the step
                continue
            ttft = cached = None
            if not seq.prefilled:
                seq.prefilled = True
                self.prompt_tokens_total += seq.prompt_tokens
                self.prompt_cached_total += seq.cached
                ttft, cached = now - seq.arrival, seq.cached
            seq.generated += 1
            self.generation_tokens_total += 1
            self.max_seq_tokens = max(self.max_seq_tokens, seq.prompt_tokens + seq.generated)
            if self.prefix is not None and seq.tokens is not None:
                self._cache_blocks(seq)
            if seq.slot is not None and seq.output is not None:
                self.slots.grow(seq.slot, seq.output[seq.generated - 1])  # type: ignore[union-attr]
            done = seq.generated >= seq.max_tokens
            e2e = None
            if done:
                del self.running[rid]
                self._leave(seq, now)
                self.requests_finished += 1
                e2e = now - seq.arrival
            emits.append(Emit(rid, seq.generated - 1, done, ttft, e2e, cached))
        return emits

    # --- what /metrics shows -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def lora_running(self) -> tuple[str, ...]:
        """The adapters with requests in the running batch (vllm:lora_requests_info's running list)."""
        return tuple(sorted({s.adapter for s in self.running.values() if s.adapter}))

    @property
    def lora_waiting(self) -> tuple[str, ...]:
        return tuple(sorted({s.adapter for s in self.waiting if s.adapter}))

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV budget holding tokens now (0..1), like vllm:kv_cache_usage_perc."""
        return min(1.0, sum(s.held for s in self.running.values()) / self.config.kv_tokens)


@dataclass(frozen=True)
class Timing:
    ttft: float
    e2e: float
    tokens: int


def simulate(config: SimConfig, arrivals: list[tuple[float, str, int, int]]) -> dict[str, Timing]:
    """Run the model on a virtual clock. `arrivals` are (time, rid, prompt_tokens, max_tokens);
    returns each request's time to first token, end-to-end latency and output length."""
    core = SimCore(config)
    pending = sorted(arrivals)
    now = 0.0
    ttft: dict[str, float] = {}
    out: dict[str, Timing] = {}
    while pending or core.running or core.waiting:
        while pending and pending[0][0] <= now:
            t, rid, p, m = pending.pop(0)
            core.submit(rid, p, m, t)
        step = core.plan_step(now)
        if step is None:
            now = max(now, pending[0][0])  # idle until the next arrival
            continue
        now += step.duration
        for e in core.finish_step(step, now):
            if e.ttft is not None:
                ttft[e.rid] = e.ttft
            if e.done:
                out[e.rid] = Timing(ttft[e.rid], e.e2e or 0.0, e.index + 1)
    return out
