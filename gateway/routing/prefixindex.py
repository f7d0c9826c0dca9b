"""What this gateway sent each endpoint, as block keys (gateway.routing.prefixkeys): an LRU per endpoint
sized to the engine's KV capacity, so "how many leading keys of this request did the endpoint see
lately" estimates how much of the prompt its prefix cache still holds.

It is the approximate index of llm-d's scheduler: built from what was sent, not from what the engine
reports it keeps (vLLM's KV events would say that; not consumed here). An engine evicts the least
recently used blocks, a sequence's last blocks first (vLLM frees a request's blocks tail first), so the
keys of a request are touched last to first: its head, shared with every later turn, stays newest.

No clock, no lock: the router calls it under its own lock (`Router.route`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping, Sequence

from gateway.routing.prefixkeys import TOKENS_PER_BLOCK

# KV capacity assumed for an endpoint that says nothing of its own (tokens): a modest GPU replica
# (vLLM's KV on a 24 GB card for a 7-8B model is ~40-100k tokens; llama.cpp's default is 4 slots of
# 4096). Too large predicts hits the engine already evicted; too small forgets ones it kept.
DEFAULT_KV_TOKENS = 32768


def blocks_for(kv_tokens: int | None) -> int:
    """Keys the index keeps for an engine holding `kv_tokens` of KV cache."""
    return max(16, int((kv_tokens or DEFAULT_KV_TOKENS) / TOKENS_PER_BLOCK))


class EndpointIndex:
    """An LRU set of block keys of at most `cap` entries."""

    __slots__ = ("cap", "keys")

    def __init__(self, cap: int):
        self.cap = cap
        self.keys: OrderedDict[int, None] = OrderedDict()

    def match(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, are held (a chain: the first missing one ends it)."""
        held = self.keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def add(self, keys: Sequence[int]) -> None:
        held = self.keys
        move = held.move_to_end
        for k in reversed(keys):  # the head last: it is the newest, evicted after the tail
            if k in held:
                move(k)
            else:
                held[k] = None
        over = len(held) - self.cap
        for _ in range(max(0, over)):
            held.popitem(last=False)

    def resize(self, cap: int) -> None:
        self.cap = cap
        for _ in range(max(0, len(self.keys) - cap)):
            self.keys.popitem(last=False)


class PrefixIndex:
    """The per-endpoint indexes of one gateway process."""

    __slots__ = ("by_ep",)

    def __init__(self):
        self.by_ep: dict[str, EndpointIndex] = {}

    def matches(self, ep_ids: Iterable[str], keys: Sequence[int]) -> dict[str, int]:
        """Leading keys matched per endpoint (only endpoints with a match are listed)."""
        out = {}
        if not keys:
            return out
        by = self.by_ep
        first = keys[0]
        for i in ep_ids:
            ix = by.get(i)
            if ix is not None and first in ix.keys:
                out[i] = ix.match(keys)
        return out

    def sent(self, ep_id: str, keys: Sequence[int], kv_tokens: int | None = None) -> None:
        """`keys` were sent to `ep_id`: its engine now holds them (until it evicts them)."""
        if not keys:
            return
        ix = self.by_ep.get(ep_id)
        if ix is None:
            ix = self.by_ep[ep_id] = EndpointIndex(blocks_for(kv_tokens))
        ix.add(keys)

    def sizes(self, kv_tokens: Mapping[str, int | None]) -> None:
        """The endpoints' KV capacities as now known: resize their indexes, forget unlisted ones."""
        for i in [i for i in self.by_ep if i not in kv_tokens]:
            del self.by_ep[i]
        for i, ix in self.by_ep.items():
            cap = blocks_for(kv_tokens[i])
            if cap != ix.cap:
                ix.resize(cap)
