"""The simulated engine's Responses API objects: a response, its stream events, and the store that
`GET`/`DELETE /v1/responses/{id}` and `previous_response_id` read. Pure builders plus a bounded,
locked dict; the server (simengine/server.py) generates the text through the batching core.

Shapes follow OpenAI's Responses API (what vLLM serves): a `response` object with one assistant
`message` whose content is one `output_text`, usage as `input_tokens`/`output_tokens`, and a stream
of named SSE events (`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` per token, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, `response.completed`), each with its
`sequence_number`. No `[DONE]` ends it.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from typing import Any


def input_text(value: Any) -> str | None:
    """The text of a request's `input` (a string, or a list of messages or content parts); None
    when it is neither."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return None
    parts = []
    for item in value:
        if isinstance(item, str):
            parts.append(item)
        elif isinstance(item, dict):
            content = item.get("content", item.get("text", ""))
            if isinstance(content, list):
                parts += [str(c.get("text", "")) for c in content if isinstance(c, dict)]
            else:
                parts.append(str(content))
    return " ".join(parts)


def context(instructions, text: str, previous: str | None) -> bytes:
    """The text a response's answer follows (simengine.tokens.answer_after): its instructions, the
    conversation it continues (by id), its input."""
    head = instructions if isinstance(instructions, str) else ""
    return f"<|system|>{head}<|previous|>{previous or ''}<|user|>{text}<|assistant|>".encode()


def new_ids() -> tuple[str, str]:
    """(response id, message id)."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def message(msg_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": content}


def response(rid: str, msg_id: str, model: str, created: int, status: str, text: str, previous: str | None,
             usage: dict | None, max_output_tokens: int | None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
        "output": [message(msg_id, text, status)] if status == "completed" else [],
        "previous_response_id": previous, "max_output_tokens": max_output_tokens,
        "parallel_tool_calls": False, "tool_choice": "auto", "tools": [], "usage": usage,
    }


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens}


class Events:
    """Numbers and frames a stream's events."""

    def __init__(self) -> None:
        self.seq = 0

    def frame(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


class Store:
    """The responses this engine keeps for retrieval (the newest `limit`)."""

    def __init__(self, limit: int = 1000):
        self.limit = limit
        self._lock = threading.Lock()
        self._items: OrderedDict[str, dict] = OrderedDict()

    def put(self, resp: dict) -> None:
        with self._lock:
            self._items[resp["id"]] = resp
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, rid: str) -> dict | None:
        with self._lock:
            return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None
