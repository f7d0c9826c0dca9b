"""The prefix-cache part of `llmgw explain` and the console's endpoint table: per endpoint, how much of
the prompts the gateways sent it they expected it to hold (their block-key index,
gateway.routing.prefixindex) against how much the engine says it reused: vLLM's own counters
(`vllm:prefix_cache_hits / _queries`, scraped by the agent into the LoadRecord) or the answers'
llama.cpp `timings.cache_n` (counted by the gateways). Pure."""

from __future__ import annotations

from typing import Iterable

from llmgw.state.demand_records import GatewayReport
from llmgw.state.records import DEFAULT_KV_TOKENS, LoadRecord


def prefix_ratios(endpoint_id: str, gateways: Iterable[GatewayReport],
                  load: LoadRecord | None) -> tuple[float | None, float | None, float]:
    """(expected hit ratio, measured hit ratio, prompt tokens routed with keys); a ratio is None
    when nothing says it."""
    sent = expected = measured_prompt = reused = 0.0
    for g in gateways:
        u = g.endpoints.get(endpoint_id)
        if u is not None and u.prefix:
            sent, expected = sent + u.prefix[0], expected + u.prefix[1]
            measured_prompt, reused = measured_prompt + u.prefix[2], reused + u.prefix[3]
    measured = reused / measured_prompt if measured_prompt else None
    if load is not None and load.ok and load.prefix_queries_total:  # the engine's own count wins
        measured = (load.prefix_hits_total or 0.0) / load.prefix_queries_total
    return (expected / sent if sent else None), measured, sent


def index_size(declared: int | None, load: LoadRecord | None) -> tuple[int, str]:
    """The KV capacity the gateways size this endpoint's index to, and where it comes from (as
    gateway.routing.prefixindex.PrefixIndex.kv_tokens decides it)."""
    if declared:
        return declared, "the catalog's kv_cache_tokens"
    if load is not None and load.kv_tokens:
        return load.kv_tokens, "the engine's"
    return DEFAULT_KV_TOKENS, "the default"


def prefix_sentence(endpoint_id: str, gateways: Iterable[GatewayReport], load: LoadRecord | None,
                    declared: int | None = None) -> str:
    """'' when there is nothing to say."""
    expected, measured, sent = prefix_ratios(endpoint_id, list(gateways), load)
    if expected is None and measured is None:
        return ""
    parts = []
    if expected is not None:
        parts.append(f"the gateways expected {expected:.0%} of the {sent:,.0f} prompt tokens they sent it cached")
    if measured is not None:
        src = "its prefix-cache counters" if load is not None and load.prefix_queries_total else "its answers"
        parts.append(f"the engine reports {measured:.0%} reused ({src})")
    size, whence = index_size(declared, load)
    parts.append(f"indexed up to {size:,} tokens ({whence})")
    return "prefix cache: " + "; ".join(parts)

