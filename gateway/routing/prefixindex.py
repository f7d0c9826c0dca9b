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
from llmgw.state.records import DEFAULT_KV_TOKENS



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
    """The per-endpoint indexes of one gateway process, each sized to its engine's KV cache as known:
    the catalog's `kv_cache_tokens`, else what the engine reports (vLLM's vllm:cache_config_info),
    else DEFAULT_KV_TOKENS."""

    __slots__ = ("by_ep", "declared", "reported")

    def __init__(self):
        self.by_ep: dict[str, EndpointIndex] = {}
        self.declared: dict[str, int] = {}  # endpoint -> the catalog's figure (replaced with each list)
        self.reported: dict[str, int] = {}  # endpoint -> the engine's (kept through a failed scrape)

    def kv_tokens(self, ep_id: str) -> int | None:
        """The KV capacity the endpoint's index is sized to; None: the default."""
        return self.declared.get(ep_id) or self.reported.get(ep_id)

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

    def sent(self, ep_id: str, keys: Sequence[int]) -> None:
        """`keys` were sent to `ep_id`: its engine now holds them (until it evicts them)."""
        if not keys:
            return
        ix = self.by_ep.get(ep_id)
        if ix is None:
            ix = self.by_ep[ep_id] = EndpointIndex(blocks_for(self.kv_tokens(ep_id)))
        ix.add(keys)

    def listed(self, declared: Mapping[str, int | None]) -> None:
        """A new endpoint list, with each endpoint's declared KV capacity (None: none): forget the
        endpoints that left it, resize the others."""
        self.declared = {i: v for i, v in declared.items() if v}
        for gone in [i for i in self.by_ep if i not in declared]:
            del self.by_ep[gone]
        self.reported = {i: v for i, v in self.reported.items() if i in declared}
        self._resize()

    def reports(self, reported: Mapping[str, int | None]) -> None:
        """The engines' own KV capacities as just scraped (None: not said this time, keep the last)."""
        changed = False
        for i, v in reported.items():
            if v and self.reported.get(i) != v:
                self.reported[i] = v
                changed = True
        if changed:
            self._resize()

    def _resize(self) -> None:
        for i, ix in self.by_ep.items():
            cap = blocks_for(self.kv_tokens(i))
            if cap != ix.cap:
                ix.resize(cap)
