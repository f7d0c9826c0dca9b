"""Precise prefix matches for one request: how many of its prompt tokens each replica that publishes
KV events holds, by the engine's own account (gateway.routing.kvindex).

The prompt is tokenized as each endpoint's engine tokenizes it (`tokenize(endpoint, op, body)`, handed
in by the composition root: the simulated engine's own tokenizer, or the model's Hugging Face
tokenizer and chat template for vLLM; once per engine and tokenizer per request), cut into that endpoint's blocks and walked down the index. An endpoint
whose engine the gateway cannot tokenize for, or that the index has not heard from, is left out: the
router predicts its match from what it sent there instead.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from gateway.routing.kvindex import Index, chain_keys
from llmgw.state.records import EndpointInfo

Tokenize = Callable[[EndpointInfo, str, Mapping[str, Any]], "list[int] | None"]  # (endpoint, op, body)


def no_tokenizer(endpoint: EndpointInfo, op: str, body: Mapping[str, Any]) -> list[int] | None:
    return None


def cached_tokens(index: Index, endpoints: Sequence[EndpointInfo], op: str, body: Mapping[str, Any] | None,
                  tokenize: Tokenize, adapter: str | None = None) -> tuple[dict[str, int], int | None]:
    """Endpoint id -> prompt tokens its prefix cache holds, for the endpoints the index listens to;
    and the prompt's length in tokens as those engines make it (None: not tokenized, or tokenized to
    different lengths by different engines' tokenizers). The length replaces the gateway's estimate
    from the body's size (a quarter of its bytes), which is what every endpoint's remaining prefill
    is priced from: with the estimate, a 1,135-token conversation was taken for 1,350 tokens, and the
    replica holding 1,024 of them was charged 326 tokens of prefill instead of 111
    (tests/e2e/test_vllm_cpu.py, where it lost the next turn to the one holding none)."""
    if not body:
        return {}, None
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    tokens_by: dict[tuple[str, str], list[int] | None] = {}
    keys_by: dict[tuple[str, str, int], list[int]] = {}
    out: dict[str, int] = {}
    length: int | None = None
    for e in endpoints:
        if not e.kv_events or not index.listening(e.id):
            continue
        size = index.block_size(e.id)
        which = (e.engine, e.tokenizer)
        if which not in tokens_by:
            tokens_by[which] = tokenize(e, op, body)
        toks = tokens_by[which]
        if toks is None:
            continue
        length = len(toks) if length is None or length == len(toks) else -1
        if not size:
            out[e.id] = 0  # heard from, nothing cached yet
            continue
        keys = keys_by.get((*which, size))
        if keys is None:
            keys = keys_by[(*which, size)] = chain_keys(toks, size, adapter, salt)
        out[e.id] = index.cached_tokens(e.id, keys, len(toks))
    return out, (length if length is not None and length > 0 else None)
