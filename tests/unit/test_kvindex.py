"""The precise prefix index: vLLM's KV event wire decoded, and folded into what each replica holds.

The batches are made by the simulated engine's publisher code (simengine.kvevents.encode_batch) from
its prefix cache's own events, in both layouts vLLM has shipped, so the index reads what an engine sends.
"""

from __future__ import annotations

import msgpack
import pytest

from gateway.routing.kvindex import Index, chain_keys
from llmgw.engines.kvwire import (AllCleared, BlocksRemoved, BlocksStored, WireError, decode_message, decode_payload,
                                  decode_replay, replay_request)
from simengine.kvevents import END_SEQ, encode_batch
from simengine.prefix import PrefixCache, chain

BS = 4


def cached(cache: PrefixCache, tokens: list[int], salt: str | None = None) -> None:
    """Run one prompt through the engine's cache: hit what it holds, store the rest, release."""
    hashes = chain(tokens, BS, salt)
    hit = cache.match(hashes, len(tokens) + 1)
    cache.acquire(hashes[:hit])
    parent = hashes[hit - 1] if hit else None
    cache.insert(hashes[hit:], parent, tokens[hit * BS:], salt)
    cache.release(hashes)


def batch(cache: PrefixCache, seq: int, layout: str = "map"):
    return decode_payload(seq, encode_batch(cache.take_events(), 1.0, BS, layout))


@pytest.mark.parametrize("layout", ["map", "array"])
def test_both_layouts_decode_to_the_same_events(layout):
    cache = PrefixCache(block_size=BS)
    cached(cache, list(range(100, 110)), salt="tenant-a")
    b = batch(cache, 7, layout)
    assert b.seq == 7
    (stored,) = b.events
    assert isinstance(stored, BlocksStored)
    assert stored.parent is None and stored.block_size == BS and stored.salt == "tenant-a"
    assert stored.token_ids == tuple(range(100, 108))  # two full blocks; the last two tokens are no block
    assert len(stored.block_hashes) == 2
    cache.fit(0)
    cache.clear()
    kinds = [type(e) for e in batch(cache, 8, layout).events]
    assert kinds == [BlocksRemoved, BlocksRemoved, AllCleared]


def test_a_message_that_is_no_batch_is_a_wire_error():
    with pytest.raises(WireError, match="3 frames"):
        decode_message([b"", b"x"])
    with pytest.raises(WireError, match="8 bytes"):
        decode_message([b"", b"x", b""])
    with pytest.raises(WireError, match="not msgpack|not a"):
        decode_payload(1, b"\xc1")
    with pytest.raises(WireError, match="not a \\[ts, events, rank\\]"):
        decode_payload(1, msgpack.packb({"a": 1}))
    with pytest.raises(WireError, match="neither a map nor a tagged list"):
        decode_payload(1, msgpack.packb([0.0, [7], 0]))
    # An event type a newer vLLM adds is skipped, not an error.
    assert decode_payload(1, msgpack.packb([0.0, [{"type": "BlockMoved"}], 0])).events == ()


def test_replay_frames_and_request():
    assert replay_request(5) == [b"", (5).to_bytes(8, "big")]
    assert decode_replay([b"", END_SEQ, b""]) is None
    payload = encode_batch([], 1.0, BS)
    assert decode_replay([b"", (3).to_bytes(8, "big"), payload]).seq == 3


def test_the_index_finds_what_the_engine_holds_and_forgets_what_it_evicts():
    cache, index = PrefixCache(block_size=BS), Index()
    system = list(range(200, 216))  # four blocks
    cached(cache, system + [1, 2, 3, 4, 5])
    assert index.apply("e0", batch(cache, 0)) is None
    turn2 = system + [1, 2, 3, 4, 5, 6, 7, 8, 9]
    keys = chain_keys(turn2, BS)
    # Five full blocks were cached (system + 1..4); the prompt of 25 tokens may hit at most 24.
    assert index.cached_tokens("e0", keys, len(turn2)) == 20
    assert index.cached_tokens("e1", keys, len(turn2)) == 0
    # Another salt (tenant) or adapter shares nothing.
    assert index.cached_tokens("e0", chain_keys(turn2, BS, salt="other"), len(turn2)) == 0
    assert index.cached_tokens("e0", chain_keys(turn2, BS, lora="ad"), len(turn2)) == 0
    # Eviction of the tail: the walk stops where the engine's cache stops.
    cache.fit(3 * BS)
    index.apply("e0", batch(cache, 1))
    assert index.cached_tokens("e0", keys, len(turn2)) == 12
    cache.clear()
    index.apply("e0", batch(cache, 2))
    assert index.cached_tokens("e0", keys, len(turn2)) == 0 and index.size("e0") == 0


def test_a_salted_chain_matches_only_its_own_salt():
    cache, index = PrefixCache(block_size=BS), Index()
    cached(cache, list(range(300, 312)), salt="a")
    index.apply("e0", batch(cache, 0))
    assert index.cached_tokens("e0", chain_keys(list(range(300, 313)), BS, salt="a"), 13) == 12
    assert index.cached_tokens("e0", chain_keys(list(range(300, 313)), BS), 13) == 0


def test_a_gap_waits_for_the_replay_and_folds_every_batch_in_order():
    cache, index = PrefixCache(block_size=BS), Index()
    cached(cache, list(range(0, 8)))
    b0 = batch(cache, 0)
    cached(cache, list(range(50, 58)))
    b1 = batch(cache, 1)
    cache.fit(0)  # both chains evicted
    b2 = batch(cache, 2)
    cached(cache, list(range(90, 98)))
    b3 = batch(cache, 3)
    assert index.folded("e0") == -1
    assert index.apply("e0", b0) is None
    assert index.folded("e0") == 0 and index.size("e0") == 2
    assert index.apply("e0", b2) == 1  # b1 was dropped: replay from 1
    assert index.apply("e0", b3) is None  # waits behind the gap
    assert index.folded("e0") == 0  # what waits behind the gap is not in the index yet
    index.replayed("e0", b1)
    index.replayed("e0", b2)
    index.replay_done("e0")
    assert index.folded("e0") == 3
    # In order, the evictions of b2 removed b0's and b1's blocks; b3's chain is held.
    assert index.cached_tokens("e0", chain_keys(list(range(0, 9)), BS), 9) == 0
    assert index.cached_tokens("e0", chain_keys(list(range(50, 59)), BS), 9) == 0
    assert index.cached_tokens("e0", chain_keys(list(range(90, 99)), BS), 9) == 8
    assert index.gaps.get("e0", 0) == 0


def test_a_replay_that_cannot_fill_the_gap_counts_the_loss_and_goes_on():
    cache, index = PrefixCache(block_size=BS), Index()
    cached(cache, list(range(0, 8)))
    index.apply("e0", batch(cache, 0))
    cached(cache, list(range(90, 98)))
    assert index.apply("e0", batch(cache, 5)) == 1
    index.replay_done("e0")  # nothing came back
    assert index.gaps["e0"] == 4
    assert index.cached_tokens("e0", chain_keys(list(range(90, 99)), BS), 9) == 8


def test_first_heard_mid_stream_asks_for_the_replay_from_zero():
    cache, index = PrefixCache(block_size=BS), Index()
    cached(cache, list(range(0, 8)))
    b0 = batch(cache, 0)
    cached(cache, list(range(0, 12)))  # extends b0's chain: its parent is in b0
    b1 = batch(cache, 1)
    assert index.apply("e0", b1) == 0
    index.replayed("e0", b0)
    index.replay_done("e0")
    assert index.cached_tokens("e0", chain_keys(list(range(0, 13)), BS), 13) == 12


def test_an_engine_that_started_again_begins_empty():
    cache, index = PrefixCache(block_size=BS), Index()
    cached(cache, list(range(0, 8)))
    index.apply("e0", batch(cache, 0))
    index.apply("e0", batch(cache, 1))
    fresh = PrefixCache(block_size=BS)
    cached(fresh, list(range(40, 48)))
    assert index.apply("e0", batch(fresh, 0)) is None
    assert index.folded("e0") == 0  # counted from the new engine's numbers
    assert index.cached_tokens("e0", chain_keys(list(range(0, 9)), BS), 9) == 0
    assert index.cached_tokens("e0", chain_keys(list(range(40, 49)), BS), 9) == 8


def test_a_block_whose_parent_was_never_seen_is_counted_not_guessed():
    cache, index = PrefixCache(block_size=BS), Index()
    cached(cache, list(range(0, 8)))
    cache.take_events()  # lost for good: never published to this index
    cached(cache, list(range(0, 12)))
    index.apply("e0", decode_payload(0, encode_batch(cache.take_events(), 1.0, BS)))
    assert index.orphans["e0"] == 1
    assert index.cached_tokens("e0", chain_keys(list(range(0, 13)), BS), 13) == 0
