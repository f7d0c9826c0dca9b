"""vLLM's automatic prefix cache, as the batching model sees it: pure, clock-free.

A prompt (and, as it grows, its answer) is cut into blocks of `block_size` tokens; each full block is
named by a hash chained from its parent's (a seed for the first, which holds the request's
`cache_salt`, as vLLM puts the salt in the first block's extra keys), so a block hash names its whole
prefix. Blocks in use by a running sequence are referenced; a block nobody references keeps its
content in a free list ordered for eviction (least recently used first, the tail of a chain before
its head) and is evicted only when its space is needed. Every change is recorded as a KV event
(`Stored`, `Removed`) for the publisher to send, in vLLM's order.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stored:
    """Blocks just cached: their hashes in chain order, the parent of the first, their tokens."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    salt: str | None = None  # the first block's extra key, when it is the chain's first


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def block_hash(parent: bytes | None, tokens: tuple[int, ...] | list[int], salt: str | None) -> bytes:
    """sha256 over the parent's hash (or a seed holding the salt) and the block's tokens."""
    h = hashlib.sha256(parent if parent is not None else b"simengine-root:" + (salt or "").encode())
    h.update(b"".join(t.to_bytes(8, "big", signed=True) for t in tokens))
    return h.digest()


def external(h: bytes) -> int:
    """The block hash in KV events and the index: its low 64 bits (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def chain(tokens: list[int], block_size: int, salt: str | None, start: bytes | None = None,
          first: int = 0) -> list[bytes]:
    """Hashes of the full blocks of `tokens` from block `first` on (`start` is block first-1's)."""
    out, parent = [], start
    for i in range(first * block_size, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tuple(tokens[i:i + block_size]), salt)
        out.append(parent)
    return out


@dataclass
class _Block:
    refs: int
    parent: bytes | None


@dataclass
class PrefixCache:
    """The cached blocks of one engine. `tokens_free(capacity_tokens - private)` evicts what no longer
    fits; counters are vLLM's (`queries`, `hits`: prompt tokens looked up and found, at admission)."""

    block_size: int = 16
    blocks: dict[bytes, _Block] = field(default_factory=dict)
    free: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # unreferenced, eviction order
    events: list[Event] = field(default_factory=list)
    queries: int = 0
    hits: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")

    # --- lookups ------------------------------------------------------------------------------
    def match(self, hashes: list[bytes], prompt_len: int) -> int:
        """How many leading blocks of a prompt are cached: at most (prompt_len - 1) tokens' worth,
        since the last prompt token is always computed again for its logits."""
        limit = max(0, (prompt_len - 1) // self.block_size)
        n = 0
        while n < min(limit, len(hashes)) and hashes[n] in self.blocks:
            n += 1
        return n

    def unreferenced(self, hashes: list[bytes]) -> int:
        return sum(1 for h in hashes if self.blocks[h].refs == 0)

    @property
    def cached_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    # --- changes ------------------------------------------------------------------------------
    def record(self, prompt_len: int, hit_blocks: int) -> None:
        self.queries += prompt_len
        self.hits += hit_blocks * self.block_size

    def acquire(self, hashes: list[bytes]) -> None:
        """Reference blocks that are cached (a hit): they leave the free list."""
        for h in hashes:
            b = self.blocks[h]
            if b.refs == 0:
                self.free.pop(h, None)
            b.refs += 1

    def insert(self, hashes: list[bytes], parent: bytes | None, tokens: list[int], salt: str | None) -> list[bytes]:
        """Cache newly computed full blocks, referenced by the sequence that computed them. A block
        already cached (computed meanwhile by another sequence) is left to that one: the returned list
        holds the hashes this call added."""
        added: list[bytes] = []
        for h in hashes:
            if h in self.blocks:
                break  # vLLM keeps a duplicate; the simulation lets the computing sequence keep its own
            self.blocks[h] = _Block(1, parent)
            added.append(h)
            parent = h
        if added:
            first_parent = self.blocks[added[0]].parent
            n = len(added) * self.block_size
            self.events.append(Stored(tuple(external(h) for h in added),
                                      external(first_parent) if first_parent is not None else None,
                                      tuple(tokens[:n]), salt if first_parent is None else None))
        return added

    def release(self, hashes: list[bytes]) -> None:
        """A sequence is done with its blocks: unreferenced ones join the free list, the chain's tail
        first (evicted before its head), as vLLM frees a request's blocks in reverse."""
        for h in reversed(hashes):
            b = self.blocks.get(h)
            if b is None:
                continue
            b.refs -= 1
            if b.refs == 0:
                self.free[h] = None

    def fit(self, room_tokens: int) -> None:
        """Evict least recently used free blocks until the cache holds at most `room_tokens`."""
        while self.free and self.cached_tokens > room_tokens:
            h, _ = self.free.popitem(last=False)
            del self.blocks[h]
            self.events.append(Removed((external(h),)))  # one event per evicted block, as vLLM sends

    def clear(self) -> bool:
        """Drop every cached block, only while none is in use (vLLM's reset_prefix_cache)."""
        if any(b.refs for b in self.blocks.values()):
            return False
        self.blocks.clear()
        self.free.clear()
        self.events.append(Cleared())
        return True

    def take_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out
