"""Client loops for end-to-end tests: threads that call the gateway until stopped and keep every
failure, with streams checked for their end (a final chunk with a finish_reason, then `[DONE]`): a
stream cut by an engine that was stopped under it ends without them and with no error status, which
most clients do not notice (the gateway now also closes such a connection without the last chunk,
gateway/relay.py, which `requests` reports as an error; over TLS it still ends cleanly)."""

from __future__ import annotations

import json
import threading
import time

import requests


class ClientLoop(threading.Thread):
    """Chat completions through the gateway, one after another, until `stop()`.

    `stream=True` reads each answer as SSE and counts it failed unless it ended properly."""

    def __init__(self, url: str, model: str, stream: bool = False, max_tokens: int = 8, timeout: float = 60,
                 headers: dict[str, str] | None = None):
        super().__init__(daemon=True)
        self.url, self.model, self.stream, self.max_tokens = url.rstrip("/"), model, stream, max_tokens
        self.timeout = timeout
        self.headers = headers or {}
        self.session = requests.Session()
        self.halt = threading.Event()
        self.ok = 0
        self.done_at: list[float] = []  # time.time() of each success (what was served before a fault)
        self.longest = 0.0  # seconds, the slowest success
        self.errors: list[str] = []

    def one(self) -> str | None:
        """One request; None if it succeeded, else what went wrong."""
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": self.max_tokens, "stream": self.stream}
        try:
            with self.session.post(self.url + "/v1/chat/completions", json=body, stream=self.stream,
                                   timeout=self.timeout, headers=self.headers) as resp:
                if resp.status_code != 200:
                    return f"HTTP {resp.status_code}: {resp.text[:200]}"
                if not self.stream:
                    doc = resp.json()
                    if not doc.get("choices") or doc["choices"][0].get("finish_reason") is None:
                        return f"incomplete answer: {str(doc)[:200]}"
                    return None
                return stream_problem(resp.iter_lines())
        except (requests.RequestException, ValueError) as e:
            return repr(e)

    def run(self) -> None:
        while not self.halt.is_set():
            began = time.time()
            problem = self.one()
            if problem is None:
                self.ok += 1
                self.done_at.append(time.time())
                self.longest = max(self.longest, self.done_at[-1] - began)
            else:
                self.errors.append(problem)

    def stop(self) -> None:
        self.halt.set()
        self.join(self.timeout + 10)


def stream_problem(lines) -> str | None:
    """None if an SSE chat stream ended properly: a chunk with a finish_reason, then `data: [DONE]`."""
    finished = done = False
    for raw in lines:
        if not raw:
            continue
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            return f"unreadable chunk {data[:100]!r}"
        if "error" in chunk:
            return f"error in stream: {data[:200]}"
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") is not None:
                finished = True
    if not finished:
        return "stream cut: no chunk with a finish_reason"
    if not done:
        return "stream cut: no [DONE]"
    return None


def start_loops(url: str, model: str, streaming: int = 2, plain: int = 2, max_tokens: int = 8,
                **kw) -> list[ClientLoop]:
    loops = ([ClientLoop(url, model, stream=True, max_tokens=max_tokens, **kw) for _ in range(streaming)]
             + [ClientLoop(url, model, stream=False, max_tokens=max_tokens, **kw) for _ in range(plain)])
    for loop in loops:
        loop.start()
    return loops


def stop_loops(loops: list[ClientLoop]) -> tuple[int, list[str]]:
    for loop in loops:
        loop.halt.set()
    for loop in loops:
        loop.stop()
    return sum(loop.ok for loop in loops), [e for loop in loops for e in loop.errors]
