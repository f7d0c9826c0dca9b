"""An endpoint's prefill seconds per prompt token, learned from its engine's counters between two
scrapes. Pure.

What a prefix-cache hit saves is prefill, and engines prefill at very different rates (a GPU replica
tens of thousands of tokens a second, llama.cpp on a CPU a few hundred), so the saving is priced at
each endpoint's own rate: the engine's prefill seconds (vLLM's `vllm:request_prefill_time_seconds`
sum, llama.cpp's `llamacpp:prompt_seconds_total`) over the prompt tokens it computed (its prompt
tokens, less its prefix-cache hits where it counts them; llama.cpp counts only the ones it computed).
Until an endpoint has shown one, `LLMGW_GATEWAY_PREFILL_MS_PER_TOKEN` stands in.

vLLM observes a request's prefill time when the request ends, but counts its prompt tokens at its
first token and its cache hits when it is scheduled: a span between two scrapes could hold a long
prompt's tokens and only the seconds of the short one before it, a sample several times too fast
(CI's vLLM run learned 1.6 ms a token on one replica and 10.2 on the other, one core each). Where the
engine counts the tokens its prefill computed with the same requests as its seconds (vLLM's
`vllm:request_prefill_kv_computed_tokens` sum, `LoadRecord.prefill_tokens_total`), those are the span's
tokens; the prompt-less-hits difference stands in only where it does not.
"""

from __future__ import annotations

from typing import NamedTuple

from llmgw.state.records import LoadRecord

MIN_TOKENS = 256.0  # computed between two scrapes: fewer say too little (one step's rounding)
ALPHA = 0.3  # weight of a new sample: follows a changed engine within a few scrapes


def prefill_seen(since: LoadRecord | None, rec: LoadRecord, prev: float | None
                 ) -> tuple[float | None, LoadRecord | None]:
    """The per-token prefill time after the scrape `rec`, and the record the next sample counts
    from. `since` is where the current span started (the record the last sample ended at); `prev`
    the estimate so far, kept while the span says too little.

    A span too short to say much (fewer than MIN_TOKENS computed) is not dropped but extended to the
    next scrape: the engine counts a prompt's cache hits when it schedules it and its prompt tokens
    when its first token is out (vLLM, the sim engine), so a scrape between the two sees hits without
    their prompt, few tokens computed, and the next one the prompt without its hits, many. Dropping
    the short spans and keeping the long ones took mostly the ones whose tokens were overcounted, so
    engines were learned faster than they are and a miss was priced below its cost (docs/history.md)."""
    if not rec.ok:
        return prev, since
    if since is None or not since.ok:
        return prev, rec
    s0, s1 = since.prefill_seconds_total, rec.prefill_seconds_total
    p0, p1 = since.prompt_tokens_total, rec.prompt_tokens_total
    if s0 is None or s1 is None or p0 is None or p1 is None or s1 < s0 or p1 < p0:
        return prev, rec  # not counted, or the counters restarted (the engine did): a new span
    c0, c1 = since.prefill_tokens_total, rec.prefill_tokens_total
    if c0 is not None and c1 is not None and c1 >= c0:
        computed = c1 - c0  # counted with the seconds, request by request
    else:
        computed = (p1 - p0) - ((rec.prefix_hits_total or 0.0) - (since.prefix_hits_total or 0.0))
    seconds = s1 - s0
    if computed < MIN_TOKENS or seconds <= 0:  # idle, or too little yet: counted with what follows
        return prev, since
    sample = seconds / computed
    return (sample if prev is None else prev + ALPHA * (sample - prev)), rec


def reuse_seen(old: LoadRecord | None, rec: LoadRecord, prev: float | None) -> float | None:
    """The share of prompt tokens the engine served from its prefix cache lately (vLLM's
    `prefix_cache_hits` over `prefix_cache_queries` between two scrapes); `prev` when they say
    nothing new or the engine does not count them."""
    if old is None or not (old.ok and rec.ok):
        return prev
    h0, h1, q0, q1 = old.prefix_hits_total, rec.prefix_hits_total, old.prefix_queries_total, rec.prefix_queries_total
    if h0 is None or h1 is None or q0 is None or q1 is None or q1 - q0 < MIN_TOKENS or h1 < h0:
        return prev
    sample = max(0.0, min(1.0, (h1 - h0) / (q1 - q0)))
    return sample if prev is None else prev + ALPHA * (sample - prev)


class PrefixTally(NamedTuple):
    """What one gateway process saw of an endpoint's prefix cache, in prompt tokens: routed with
    block keys, expected cached there (the index's prediction), of answers that said what they
    reused, and reused by the engine's account. The gateway report carries it to `llmgw explain`."""

    routed: float = 0.0
    expected: float = 0.0
    answered: float = 0.0
    reused: float = 0.0


NO_TALLY = PrefixTally()
TRUST_MIN_TOKENS = 20000.0  # prompt tokens the answers must have reported before the ratio is trusted


def trust_of(tally: PrefixTally | None) -> float:
    """How much of an expected prefix hit the engine really kept, from the router's tally (prompt
    tokens routed with keys, expected cached, prompt tokens of answers that reported reuse, reused):
    the measured hit ratio over the expected one, at most 1. An engine that keeps less than the index
    says (llama.cpp's slots keep one prompt each, not every block sent) then has its hits priced at
    what they are worth, and the router stops piling requests onto it for hits that are not there."""
    if not tally or tally.answered < TRUST_MIN_TOKENS or tally.routed <= 0 or tally.expected <= 0:
        return 1.0
    expected = tally.expected / tally.routed
    measured = tally.reused / tally.answered
    return max(0.0, min(1.0, measured / expected))


def reuse_of(tally: PrefixTally | None) -> float | None:
    """The share of prompt tokens reused by the answers that said (llama.cpp's `timings.cache_n`),
    from the router's tally; None until they have said enough (TRUST_MIN_TOKENS)."""
    if not tally or tally.answered < TRUST_MIN_TOKENS:
        return None
    return max(0.0, min(1.0, tally.reused / tally.answered))
