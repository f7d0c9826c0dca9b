"""Block keys of a request's prompt, pure: `prefix_of(body, op, model, adapter) -> (keys, prompt tokens)`.

An engine with a prefix cache (vLLM's automatic prefix caching, llama.cpp's slots) skips the prefill of
the leading tokens it still holds from an earlier request. The gateway cannot tokenize, so it
approximates as llm-d's scheduler does in its approximate mode: the text the engine will see (chat
messages' roles and contents in order, a completion's prompt, a Responses `input`), cut in fixed
BLOCK_BYTES blocks, each block's key a hash chained over everything before it. Two requests share
their first n keys exactly when their texts share the first n blocks, so "how many leading keys of
this request did that endpoint see" estimates how much of its prompt the endpoint may still hold.

The chain starts from a seed of the served model, the adapter and the request's optional
`cache_salt` (vLLM's field of that name): different models, adapters or tenants never share a key.
The chain is CRC-32 continued over the bytes (zlib's C code, about 1 us per kilobyte), the same in
every gateway process (Python's own `hash` is salted per process), so gateways agree on keys.
Long prompts keep MAX_BLOCKS keys: the gain past them is the same on every endpoint that matched them.
"""

from __future__ import annotations

import zlib

from llmgw.surface import CHAT, COMPLETIONS, RESPONSES

BLOCK_BYTES = 64  # as llm-d's approximate prefix scorer; ~16 tokens of English text
BYTES_PER_TOKEN = 4.0  # typical for English with BPE tokenizers: how many tokens a matched block saves
TOKENS_PER_BLOCK = BLOCK_BYTES / BYTES_PER_TOKEN
MAX_BLOCKS = 512  # 32 KB of prompt, ~8k tokens


def prompt_text(body: dict, op: str) -> bytes | None:
    """The prompt as the engine will see it, serialized to bytes in order; None when the body has
    none the gateway can read (embeddings, forms, a malformed body: the engine says what is wrong)."""
    if op == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        parts = []
        for m in msgs:
            if isinstance(m, dict):
                parts.append(str(m.get("role", "")) + "\x1f" + _content(m.get("content")))
        return "\x1e".join(parts).encode("utf-8", "surrogatepass") if parts else None
    if op == COMPLETIONS:
        p = body.get("prompt")
    elif op == RESPONSES:
        p = body.get("input")
        if isinstance(p, list):  # a list of input items: the messages' roles and contents, in order
            return "\x1e".join(str(m.get("role", "")) + "\x1f" + _content(m.get("content"))
                               for m in p if isinstance(m, dict)).encode("utf-8", "surrogatepass") or None
        instr = body.get("instructions")
        if isinstance(instr, str) and isinstance(p, str):
            p = "system\x1f" + instr + "\x1e" + p
    else:
        return None
    if isinstance(p, str):
        return p.encode("utf-8", "surrogatepass") or None
    if isinstance(p, list) and p and isinstance(p[0], str):  # several prompts: the first one's cache
        return p[0].encode("utf-8", "surrogatepass") or None
    return None


def _content(c) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: their text, in order (images are left out)
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def seed_of(model: str, adapter: str = "", salt: str = "") -> int:
    return zlib.crc32(f"{model}\x00{adapter}\x00{salt}\x00".encode("utf-8", "surrogatepass"))


def block_keys(text: bytes, seed: int, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """The chained key after each whole block of `text` (a partial last block has none: an engine
    caches whole blocks too), at most `max_blocks`."""
    n = min(len(text) // BLOCK_BYTES, max_blocks)
    keys = []
    h = seed
    mv = memoryview(text)
    crc = zlib.crc32
    for i in range(0, n * BLOCK_BYTES, BLOCK_BYTES):
        h = crc(mv[i:i + BLOCK_BYTES], h)
        keys.append(h)
    return tuple(keys)


def opens_conversation(body: dict | None, op: str) -> bool:
    """Whether the request starts a conversation: its prompt holds no earlier answer (a chat or a
    Responses input with no assistant message, a Responses request without `previous_response_id`, a
    plain completion prompt). What it matches anywhere is then a shared head (a system prompt), and
    where it goes is where its later turns will find their history."""
    if not isinstance(body, dict):
        return False
    if op == CHAT:
        msgs = body.get("messages")
        return isinstance(msgs, list) and not any(isinstance(m, dict) and m.get("role") == "assistant" for m in msgs)
    if op == RESPONSES:
        if body.get("previous_response_id"):
            return False
        items = body.get("input")
        return not (isinstance(items, list) and any(isinstance(m, dict) and m.get("role") == "assistant"
                                                    for m in items))
    return op == COMPLETIONS


def prefix_of(body: dict | None, op: str, model: str, adapter: str = "") -> tuple[tuple[int, ...], float]:
    """The block keys of a JSON request body for `model` (its canonical name) and `adapter`, and its
    prompt's length in tokens (estimated); ((), 0.0) when it has no readable prompt."""
    if body is None:
        return (), 0.0
    text = prompt_text(body, op)
    if not text:
        return (), 0.0
    salt = body.get("cache_salt")
    keys = block_keys(text, seed_of(model, adapter, salt if isinstance(salt, str) else ""))
    return keys, len(text) / BYTES_PER_TOKEN
