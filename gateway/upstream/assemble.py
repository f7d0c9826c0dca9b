"""A whole OpenAI answer built from the engine's stream of it. Pure.

Why: llama-server notices a client that went away only while it streams (between tokens); a
non-streamed request runs to its last token for nobody. So the gateway asks llama.cpp endpoints for
a stream even when the client did not (gateway.request.call), reads it, and answers the client with
the one JSON body the engine would have sent: closing that stream when the client leaves aborts the
generation at once.

What a whole answer has is kept: per choice the text (chat: `content`, `reasoning_content`, the
`tool_calls` merged by index, their `arguments` joined), `finish_reason`, `logprobs`; the answer's
`id`, `created`, `model`, `system_fingerprint`, `usage` (the stream is asked for it) and llama.cpp's
`timings`. An `error` event becomes the answer's error.
"""

from __future__ import annotations

import json
from typing import Any

# Per-answer fields copied from the events as they come (the last one seen wins).
TOP = ("id", "created", "model", "system_fingerprint", "usage", "timings")


class Assembler:
    """Feed it the stream's bytes as they arrive (`feed`); `result()` gives (status, JSON body)."""

    __slots__ = ("chat", "held", "top", "choices", "error", "events")

    def __init__(self, chat: bool):
        self.chat = chat
        self.held = b""
        self.top: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.error: Any = None
        self.events = 0

    def feed(self, data: bytes) -> None:
        data = self.held + data if self.held else data
        lines = data.split(b"\n")
        self.held = lines.pop()  # the incomplete last line (b"" when the piece ended one)
        for line in lines:
            self._line(line)

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return  # an event name, a comment, the blank line between events
        text = line[5:].strip()
        if not text or text == b"[DONE]":
            return
        try:
            event = json.loads(text)
        except (ValueError, RecursionError):
            return  # not JSON: nothing a whole answer would carry
        if not isinstance(event, dict):
            return
        self.events += 1
        if "error" in event:
            self.error = event["error"]
            return
        for k in TOP:
            v = event.get(k)
            if v is not None:
                self.top[k] = v
        for c in event.get("choices") or ():
            if isinstance(c, dict):
                self._choice(c)

    def _choice(self, c: dict) -> None:
        i = c.get("index", 0)
        cur = self.choices.get(i)
        if cur is None:
            cur = self.choices[i] = {"index": i, "parts": {}, "tools": {}, "role": "assistant",
                                     "finish_reason": None, "logprobs": None}
        if c.get("finish_reason") is not None:
            cur["finish_reason"] = c["finish_reason"]
        lp = c.get("logprobs")
        if isinstance(lp, dict):  # chat: {"content": [...]}; completions: lists per field
            acc = cur["logprobs"] if isinstance(cur["logprobs"], dict) else {}
            for k, v in lp.items():
                if isinstance(v, list):
                    acc[k] = (acc.get(k) or []) + v
                else:
                    acc[k] = v
            cur["logprobs"] = acc
        if not self.chat:
            if isinstance(c.get("text"), str):
                cur["parts"]["text"] = cur["parts"].get("text", "") + c["text"]
            return
        delta = c.get("delta") or {}
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("role"), str):
            cur["role"] = delta["role"]
        for k in ("content", "reasoning_content", "refusal"):
            if isinstance(delta.get(k), str):
                cur["parts"][k] = cur["parts"].get(k, "") + delta[k]
        for t in delta.get("tool_calls") or ():
            if isinstance(t, dict):
                self._tool(cur["tools"], t)

    @staticmethod
    def _tool(tools: dict, t: dict) -> None:
        i = t.get("index", len(tools))
        cur = tools.get(i)
        if cur is None:
            cur = tools[i] = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        if t.get("id"):
            cur["id"] = t["id"]
        if t.get("type"):
            cur["type"] = t["type"]
        fn = t.get("function") or {}
        if isinstance(fn, dict):
            if isinstance(fn.get("name"), str):
                cur["function"]["name"] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                cur["function"]["arguments"] += fn["arguments"]

    def result(self) -> tuple[int, bytes]:
        """The whole answer: (200, body), or the engine's error (500, its error body); the engine
        sent no event at all: (502, an error body)."""
        if self.held:
            self._line(self.held)
            self.held = b""
        if self.error is not None:
            return 500, json.dumps({"error": self.error}).encode()
        if not self.events:
            return 502, json.dumps({"error": {"message": "the engine's stream ended without an answer",
                                              "type": "server_error", "code": "upstream_error"}}).encode()
        out: dict[str, Any] = {"id": self.top.get("id", ""),
                               "object": "chat.completion" if self.chat else "text_completion",
                               "created": self.top.get("created", 0), "model": self.top.get("model", "")}
        if "system_fingerprint" in self.top:
            out["system_fingerprint"] = self.top["system_fingerprint"]
        out["choices"] = [self._whole(self.choices[i]) for i in sorted(self.choices)]
        if "usage" in self.top:
            out["usage"] = self.top["usage"]
        if "timings" in self.top:
            out["timings"] = self.top["timings"]
        return 200, json.dumps(out).encode()

    def _whole(self, cur: dict) -> dict:
        parts = cur["parts"]
        if not self.chat:
            return {"index": cur["index"], "text": parts.get("text", ""), "logprobs": cur["logprobs"],
                    "finish_reason": cur["finish_reason"]}
        msg: dict[str, Any] = {"role": cur["role"], "content": parts.get("content")}
        for k in ("reasoning_content", "refusal"):
            if k in parts:
                msg[k] = parts[k]
        if cur["tools"]:
            msg["tool_calls"] = [cur["tools"][i] for i in sorted(cur["tools"])]
            if not parts.get("content"):
                msg["content"] = None
        elif msg["content"] is None:
            msg["content"] = ""
        return {"index": cur["index"], "message": msg, "logprobs": cur["logprobs"],
                "finish_reason": cur["finish_reason"]}
