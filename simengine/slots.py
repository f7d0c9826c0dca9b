"""llama.cpp's slots, as the batching model sees them: pure, clock-free.

llama-server runs `-np N` slots; each keeps the tokens of its last request (prompt and answer) in
its part of the KV cache (`cache_prompt`, on by default). A new request takes the idle slot whose
tokens share the longest common prefix with its prompt, as a fraction of the prompt, if that
fraction is above `--slot-prompt-similarity` (0.1); otherwise the idle slot least recently used
(`get_available_slot` in tools/server/server-context.cpp). The shared prefix is not computed again,
except the prompt's last token (its logits are needed): that count is the answer's `timings.cache_n`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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
        """Start `prompt` on `slot`; returns the prompt tokens reused from what the slot held."""
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
