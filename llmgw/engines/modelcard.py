"""What an engine's `GET /v1/models` says about its model beyond its names: the context length.

vLLM (and the simulated engine) report `max_model_len`, llama-server `meta.n_ctx` (the context of
one slot); some hosted APIs `context_length` or `context_window`. Read from the first model listed:
every llmgw endpoint serves one model under its names.
"""

from __future__ import annotations

import json

_FIELDS = ("max_model_len", "context_length", "context_window")


def context_length(body: bytes | str) -> int | None:
    """The context length a `/v1/models` answer reports, or None (not reported, or not JSON)."""
    try:
        doc = json.loads(body)
        card = (doc.get("data") or [])[0]
    except (ValueError, AttributeError, IndexError, TypeError):
        return None
    if not isinstance(card, dict):
        return None
    meta = card.get("meta")
    for value in (*(card.get(f) for f in _FIELDS), meta.get("n_ctx") if isinstance(meta, dict) else None):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
