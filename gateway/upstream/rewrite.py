"""What the gateway changes in an engine's answer before the client sees it. Pure, on bytes.

- The `model` the answer names becomes the name the client asked for: llama-server answers with its
  first alias (or "default"), vLLM with its served name, an adapter's request with the base model's;
  the OpenAI API (and LiteLLM, vLLM's router) answer with the model the client named. Every `"model"`
  key of the JSON is rewritten in place, bytes around it untouched; a key inside a string value (a
  tool call's arguments) has escaped quotes and never matches.
- A Responses answer's ids become the client's (gateway.response_ids.IdRewrite).

A stream is rewritten line by line: a receive may end in the middle of an event (`data: {"mo` |
`del": ...`), so the incomplete last line is held until the next receive completes it (a client
cannot use half an event anyway) and passed on as it is when the stream ends. `[DONE]`, comments and
anything that is not JSON pass untouched. Per piece, when the model already matches: a count or two.
"""

from __future__ import annotations

import json
import re
from typing import Iterable, Iterator

from gateway.response_ids import IdRewrite

MODEL_KEY = b'"model"'
# A "model" key and its string value (escapes included); a value that is not a string is left alone.
MODEL_VALUE = re.compile(rb'"model"(\s*:\s*)"((?:[^"\\]|\\.)*)"')
MAX_HELD = 1 << 20  # an "event" longer than this without a newline is not an engine's: passed on as is


def rename_model(data: bytes, escaped: bytes) -> bytes:
    """`data` with every JSON `"model": "..."` value set to `escaped` (a JSON string's content,
    without its quotes). Returns `data` itself when nothing changes."""
    n = data.count(MODEL_KEY)
    if not n or data.count(b'"model":"' + escaped + b'"') == n:  # none, or all named so already
        return data

    def sub(m: re.Match) -> bytes:
        return m.group(0) if m.group(2) == escaped else b'"model"' + m.group(1) + b'"' + escaped + b'"'

    return MODEL_VALUE.sub(sub, data)


def escaped_name(name: str) -> bytes:
    return json.dumps(name).encode()[1:-1]


class AnswerRewrite:
    """The rewrite of one answer: `body(payload)` for a whole JSON answer; for a stream, `chunk(data)`
    per receive (may return b"": the piece is held) and `end()` once when it ends (what was held)."""

    __slots__ = ("escaped", "ids", "held")

    def __init__(self, model: str, ids: IdRewrite | None = None):
        self.escaped = escaped_name(model)
        self.ids = ids
        self.held = b""

    def body(self, payload: bytes) -> bytes:
        if self.ids is not None:
            payload = self.ids.body(payload)
        return rename_model(payload, self.escaped)

    def _lines(self, data: bytes) -> bytes:
        if self.ids is not None:
            data = self.ids.chunk(data)
        return rename_model(data, self.escaped)

    def chunk(self, data: bytes) -> bytes:
        if self.held:
            data, self.held = self.held + data, b""
        nl = data.rfind(b"\n")
        if nl < 0:
            if len(data) <= MAX_HELD:
                self.held = data
                return b""
            return data
        if nl + 1 < len(data):
            data, self.held = data[:nl + 1], data[nl + 1:]
        return self._lines(data)

    def end(self) -> bytes:
        """What was held when the stream ended: the engine's last line, rewritten if it is whole JSON."""
        held, self.held = self.held, b""
        return self._lines(held) if held else b""

    def stream(self, pieces: Iterable[bytes]) -> Iterator[bytes]:
        """The rewritten stream of `pieces` (pieces entirely held are not yielded)."""
        for data in pieces:
            out = self.chunk(data)
            if out:
                yield out
        tail = self.end()
        if tail:
            yield tail
