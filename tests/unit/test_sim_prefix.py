"""The sim engine's prefix caches on a virtual clock: vLLM's blocks and llama.cpp's slots."""

import pytest

from simengine import tokens as tok
from simengine.core import SimConfig, SimCore
from simengine.prefix import PrefixCache, Removed, Stored, chain, external
from simengine.slots import Slots

CFG = SimConfig(max_seqs=4, kv_tokens=4096, step_ms=10.0, batch_alpha=0.0, prefill_ms_per_token=1.0)


def run(core: SimCore, now: float = 0.0) -> tuple[float, dict]:
    """Step until idle; returns the clock and each request's first-token Emit."""
    firsts = {}
    while (step := core.plan_step(now)) is not None:
        now += step.duration
        for e in core.finish_step(step, now):
            if e.ttft is not None:
                firsts[e.rid] = e
    return now, firsts


def submit(core, rid, prompt, out=3, now=0.0, salt=None):
    core.submit(rid, len(prompt), out, now, tokens=prompt, output=[900_000 + i for i in range(out)], salt=salt)


def test_a_repeated_prefix_hits_whole_blocks_and_skips_their_prefill():
    core = SimCore(CFG, prefix=PrefixCache(16))
    system = list(range(1000, 1100))  # 100 tokens: 6 full blocks
    submit(core, "a", system + [1, 2, 3])
    t, first = run(core)
    assert first["a"].cached == 0 and first["a"].ttft == pytest.approx(0.010 + 0.103)
    submit(core, "b", system + [7, 8, 9, 10], now=t)
    t2, first = run(core, t)
    assert first["b"].cached == 96  # six blocks; the tail is computed again
    assert first["b"].ttft == pytest.approx(0.010 + (104 - 96) * 0.001)
    p = core.prefix
    assert (p.queries, p.hits) == (103 + 104, 96)
    assert core.prompt_cached_total == 96


def test_requests_admitted_in_one_step_share_the_blocks_the_first_is_scheduled_to_compute():
    """vLLM registers a request's full blocks when it schedules them (before the forward pass), so
    conversations over one system prompt arriving together compute it once: the next in the same
    step finds it. Cached only after the step, each computed it again, and a router that sends them
    to one engine paid for every copy."""
    core = SimCore(CFG, prefix=PrefixCache(16))
    system = list(range(1000, 1100))  # 6 full blocks
    submit(core, "a", system + [1, 2, 3])
    submit(core, "b", system + [7, 8, 9, 10])
    step = core.plan_step(0.0)
    assert set(step.prefill) == {"a", "b"}
    assert step.duration == pytest.approx(0.010 + 0.103 + (104 - 96) * 0.001)  # b computes only its tail
    _, first = run(core)
    assert (first["a"].cached, first["b"].cached) == (0, 96)
    assert (core.prefix.queries, core.prefix.hits) == (103 + 104, 96)


def test_the_last_prompt_token_is_always_computed():
    core = SimCore(CFG, prefix=PrefixCache(16))
    prompt = list(range(32))
    for i in range(2):
        submit(core, f"r{i}", prompt)
        _, first = run(core)
    assert first["r1"].cached == 16  # a fully cached 32-token prompt still computes its last block


def test_a_salt_keeps_tenants_apart():
    core = SimCore(CFG, prefix=PrefixCache(16))
    prompt = list(range(64))
    submit(core, "a", prompt, salt="tenant-a")
    run(core)
    submit(core, "b", prompt, salt="tenant-b")
    submit(core, "c", prompt, salt="tenant-a")
    _, first = run(core)
    assert (first["b"].cached, first["c"].cached) == (0, 48)


def test_the_answer_is_cached_so_the_next_turn_hits_it():
    core = SimCore(CFG, prefix=PrefixCache(4))
    messages = [{"role": "system", "content": "x" * 60}, {"role": "user", "content": "hello"}]
    gen = tok.answer_words("s")
    words = [next(gen) for _ in range(12)]
    t1 = tok.chat_tokens(messages)
    core.submit("t1", len(t1), 12, 0.0, tokens=t1, output=[tok.word_token(w) for w in words])
    t, _ = run(core)
    t2 = tok.chat_tokens(messages + [{"role": "assistant", "content": "".join(words)}, {"role": "user", "content": "more"}])
    core.submit("t2", len(t2), 2, t, tokens=t2, output=[5, 6])
    _, first = run(core, t)
    # the first turn's prompt and all of its answer but the last token were computed, in blocks of 4
    assert first["t2"].cached == (len(t1) + 12 - 1) // 4 * 4


def test_blocks_in_use_are_shared_and_unused_ones_evicted_lru_under_kv_pressure():
    cfg = SimConfig(max_seqs=4, kv_tokens=128, step_ms=10.0, prefill_ms_per_token=0.0)
    core = SimCore(cfg, prefix=PrefixCache(16))
    old, new = list(range(100, 164)), list(range(500, 564))  # 4 blocks each
    submit(core, "old", old, out=8)
    run(core)
    p = core.prefix
    p.take_events()
    assert p.cached_tokens == 64 + 0  # its prompt's 4 blocks stay cached after it finished
    submit(core, "new", new, out=60)  # needs 124 of 128 tokens: the old blocks must go
    run(core)
    events = p.take_events()
    removed = [h for e in events if isinstance(e, Removed) for h in e.block_hashes]
    stored = [e for e in events if isinstance(e, Stored)]
    old_hashes = [external(h) for h in chain(old, 16, None)]
    assert sorted(removed) == sorted(old_hashes)
    assert removed[0] == old_hashes[-1]  # the chain's tail goes first
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tuple(new)
    submit(core, "again", old, out=1)
    _, first = run(core)
    assert first["again"].cached == 0  # evicted: computed again


def test_a_request_waits_for_kv_while_cached_blocks_never_block_it():
    cfg = SimConfig(max_seqs=4, kv_tokens=100, step_ms=10.0, prefill_ms_per_token=0.0)
    core = SimCore(cfg, prefix=PrefixCache(16))
    submit(core, "a", list(range(40)), out=20)  # reserves 60
    submit(core, "b", list(range(200, 230)), out=20)  # 50 more: waits
    assert core.plan_step().batch == ("a",) and core.num_waiting == 1
    run(core)
    assert core.prefix.cached_tokens > 0
    submit(core, "c", list(range(300, 380)), out=20)  # 100: fits once the cache gives way
    assert core.plan_step().batch == ("c",)


def test_no_tokens_no_cache_and_the_old_timing_holds():
    core = SimCore(CFG, prefix=PrefixCache(16))
    core.submit("a", 100, 2, 0.0)
    core.submit("b", 100, 2, 0.0)
    _, first = run(core)
    assert first["b"].cached == 0 and core.prefix.queries == 0


# --- llama.cpp slots ------------------------------------------------------------------------------
def test_the_next_turn_lands_on_its_slot_and_reports_cache_n():
    core = SimCore(SimConfig(max_seqs=2, kv_tokens=8192, step_ms=10.0, prefill_ms_per_token=1.0), slots=Slots(2))
    conv_a, conv_b = list(range(1000, 1200)), list(range(5000, 5200))
    submit(core, "a1", conv_a, out=4)
    submit(core, "b1", conv_b, out=4)
    t, _ = run(core)
    slot_of = {tuple(s.tokens[:200]): s.id for s in core.slots.slots}
    a2 = conv_a + [900_000, 900_001, 900_002, 900_003] + [7, 8, 9]
    submit(core, "a2", a2, out=2, now=t)
    _, first = run(core, t)
    assert first["a2"].cached == 204  # the prompt and the answer it held
    assert core.slots.cached_total == 204
    assert [s.id for s in core.slots.slots if s.tokens[:200] == conv_a] == [slot_of[tuple(conv_a)]]


def test_a_dissimilar_prompt_takes_the_least_recently_used_slot():
    slots = Slots(3, similarity=0.5)
    for s, (prompt, used) in zip(slots.slots, (([1, 2, 3, 4], 5.0), ([9, 9, 9, 9], 2.0), ([7, 7], 9.0))):
        s.tokens, s.last_used = list(prompt), used
    assert slots.choose([1, 2, 3, 5]).id == 0  # 3/4 shared, above 0.5
    assert slots.choose([1, 5, 5, 5]).id == 1  # 1/4: below the threshold, so the oldest
    slots.slots[1].busy = True
    assert slots.choose([1, 5, 5, 5]).id == 0
    assert slots.take(slots.slots[0], [1, 2, 3, 4]) == 3  # all four match, the last is computed again


def test_the_prompt_cache_keeps_what_a_slot_gave_up_and_restores_it():
    """llama-server's host-memory prompt cache (--cache-ram): one slot, two conversations taking turns;
    each turn finds its conversation again (restored from the cache) instead of prefilling it."""
    slots = Slots(1, cache_tokens=10_000)
    conv_a, conv_b = list(range(1000, 1400)), list(range(5000, 5400))
    s = slots.choose(conv_a)
    assert slots.take(s, conv_a) == 0
    slots.release(s, 1.0)
    assert slots.take(slots.choose(conv_b), conv_b) == 0  # a saved, b prefilled
    slots.release(s, 2.0)
    assert [c[:1] for c in slots.cache] == [[1000]]
    assert slots.take(slots.choose(conv_a + [1, 2]), conv_a + [1, 2]) == 400  # a restored, b saved
    assert [c[:1] for c in slots.cache] == [[5000]]
    slots.release(s, 3.0)
    without = Slots(1)
    t = without.choose(conv_a)
    for p in (conv_a, conv_b, conv_a + [1, 2]):
        cached = without.take(t, p)
        without.release(t, 1.0)
    assert cached == 0  # each slot keeping only its last prompt: lost


def test_the_prompt_cache_drops_its_oldest_prompts_past_its_limit_and_skips_poor_matches():
    slots = Slots(1, cache_tokens=900)
    s = slots.slots[0]
    for base in range(4):  # four prompts of 400 tokens each replace one another
        p = list(range(base * 10_000, base * 10_000 + 400))
        slots.take(s, p)
        slots.release(s, float(base))
    assert [c[0] for c in slots.cache] == [10_000, 20_000]  # 800 tokens kept, the oldest dropped
    # a prompt sharing a tenth of a cached one (it would keep under a quarter of it) restores nothing
    short = list(range(20_000, 20_040)) + [7] * 400
    assert slots.take(s, short) == 0
    assert [c[0] for c in slots.cache][-1] == 30_000  # what the slot held was saved


def test_bad_cache_settings_are_refused():
    with pytest.raises(ValueError):
        PrefixCache(0)
    with pytest.raises(ValueError):
        Slots(0)
    with pytest.raises(ValueError, match="slots must equal max_seqs"):
        SimCore(SimConfig(max_seqs=4), slots=Slots(2))
    with pytest.raises(ValueError, match="either"):
        SimCore(SimConfig(max_seqs=2), prefix=PrefixCache(), slots=Slots(2))


def test_tokens_round_trip_and_the_template_keeps_the_old_counts():
    assert tok.detokenize(tok.tokenize("hello world")) == "hello world"
    assert len(tok.tokenize("once upon a time")) == 4
    assert len(tok.chat_tokens([{"role": "user", "content": "x"}])) == 2 + 4 + 1
    words = tok.answer_words("seed")
    answer = "".join(next(words) for _ in range(5))
    assert len(answer.split()) == 5 and len(tok.tokenize(answer)) == 5


def test_the_tokenizer_is_four_bytes_a_token_after_a_marker_byte_whatever_the_text():
    """tokenize unpacks whole 4-byte pieces at once: the same tokens as reading each piece behind 0x01."""
    import random

    from simengine import tokens as tk

    rng = random.Random(7)
    for n in range(120):
        text = "".join(rng.choice("ab é€😀 \n") for _ in range(n))
        raw = text.encode()
        assert tk.tokenize(text) == [int.from_bytes(b"\x01" + raw[i:i + 4], "big") for i in range(0, len(raw), 4)]
        assert tk.detokenize(tk.tokenize(text)) == text
