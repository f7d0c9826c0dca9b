"""The simulated engine's tokenizer and chat template: deterministic, reversible, and cheap.

A token is up to four UTF-8 bytes of one message's text, taken in order (so a count matches the old
estimate of one token per four characters), encoded as an integer that `detokenize` turns back into
the same bytes. The chat template wraps each message in four marker tokens and ends with two for the
reply header, like a real template: one conversation's next turn starts with the same tokens as the
last one, so a prefix cache sees it. The engine's answer is made of four-byte words, so an answer
sent back as the next turn's history tokenizes to the very tokens that were generated.
"""

from __future__ import annotations

import hashlib
import math
import struct
import random
from typing import Any, Iterator

# Template markers: small integers, below every text token (those are at least 2**8).
BEGIN, END, NEWLINE = 1, 2, 3
ROLES = {"system": 10, "user": 11, "assistant": 12, "tool": 13, "developer": 14}
OTHER_ROLE = 19

# The answer's words: a four-letter first word, then " " + three letters, four bytes each.
FIRST_WORDS = ("sure", "here", "well", "yes,", "okay", "this", "that", "then")
WORDS = ("the", "and", "for", "one", "way", "can", "use", "all", "new", "now", "key", "set", "run",
         "fit", "sum", "per", "its", "low", "top", "end")


_MARK = 1 << 32


def tokenize(text: str) -> list[int]:
    raw = text.encode()
    # A full 4-byte piece is 0x01 then its bytes: 2**32 + the piece read big-endian (unpacked in one
    # call: the gateway tokenizes every prompt for an engine that publishes KV events).
    whole = len(raw) // 4
    out = [_MARK + v for v in struct.unpack(f">{whole}I", raw[:4 * whole])]
    if len(raw) % 4:
        out.append(int.from_bytes(b"\x01" + raw[4 * whole:], "big"))
    return out


def detokenize(tokens: list[int]) -> str:
    out = b""
    for t in tokens:
        piece = t.to_bytes(max(1, (t.bit_length() + 7) // 8), "big")
        out += piece[1:] if piece[:1] == b"\x01" else b""
    return out.decode(errors="replace")


def estimate_tokens(text: str) -> int:
    """How many tokens `tokenize` makes of ASCII text, at least one."""
    return max(1, math.ceil(len(text.encode()) / 4))


def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def chat_tokens(messages: list[Any]) -> list[int]:
    """The prompt a chat request becomes: per message BEGIN, role, its text, END, NEWLINE (4 tokens
    plus the text); then the reply header BEGIN, assistant (2), which starts an assistant message of
    the history the same way, as ChatML's `<|im_start|>assistant` does."""
    out: list[int] = []
    for m in messages:
        if isinstance(m, dict):
            text = tokenize(content_text(m.get("content"))) or tokenize(" ")
            out += [BEGIN, ROLES.get(str(m.get("role")), OTHER_ROLE), *text, END, NEWLINE]
    return out + [BEGIN, ROLES["assistant"]]


def prompt_tokens(prompt: Any) -> list[int] | None:
    """A completion request's prompt as tokens (a string, token ids, or one string in a list); None
    when it is none of these."""
    if isinstance(prompt, str):
        return tokenize(prompt) or tokenize(" ")
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return tokenize(prompt[0]) or tokenize(" ")
    return None


def chat_context(messages: list[Any]) -> bytes:
    """A chat prompt's text as the model reads it (a ChatML-like rendering), up to the reply header:
    the text an answer continues. A continued assistant message's text follows it directly."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            role = str(m.get("role"))
            out.append(f"<|{role}|>{content_text(m.get('content'))}<|end|>\n".encode())
    return b"".join(out) + b"<|assistant|>"


def prompt_context(prompt: Any) -> bytes:
    """A completion prompt's text (token ids: their numbers): the text its answer continues."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode()
    return b"".join(b"%d," % t for t in prompt) if isinstance(prompt, list) else b""


def answer_after(context: bytes, n: int, continued: bool, salt: str = "", opening: str = "") -> list[str]:
    """The `n` words that follow `context`, as a model at temperature 0 would write them: each word
    depends only on the text before it (hashed as it grows), so the answer to a prompt continued
    with the first k words of its answer is the rest of that answer, word for word. `continued`: the
    context already holds part of the answer (no opening word); `salt` (the engine's --seed, an
    adapter) stands for the weights; `opening` is written before an answer's first word."""
    h = hashlib.sha256(salt.encode() + b"\0" + context)
    out = []
    for i in range(n):
        d = h.copy().digest()
        word = (" " + WORDS[d[0] % len(WORDS)]) if continued or i else opening + FIRST_WORDS[d[0] % len(FIRST_WORDS)]
        out.append(word)
        h.update(word.encode())
    return out


def answer_words(seed: str) -> Iterator[str]:
    """The words of one answer (seeded): each one token of four bytes."""
    rng = random.Random(seed)
    yield rng.choice(FIRST_WORDS)
    while True:
        yield " " + rng.choice(WORDS)


def word_token(word: str) -> int:
    return tokenize(word)[0]
