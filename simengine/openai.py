"""OpenAI payloads of the simulated engine: a chat or text completion request read into a `Job`, and
the answers built from it (whole bodies, stream chunks, llama-server's `timings`). Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from simengine import tokens as tok


class BadRequest(Exception):
    def __init__(self, status: int, message: str, type_: str):
        self.status, self.message, self.type = status, message, type_
        super().__init__(message)


@dataclass(frozen=True)
class Job:
    """What a completion request asks for, as the engine sees it."""

    chat: bool
    model: str
    tokens: list[int]  # the prompt, as the engine tokenizes it (chat template applied)
    max_tokens: int
    explicit: bool  # max_tokens was given: the answer ends by length, not by a stop
    stream: bool
    include_usage: bool
    salt: str | None
    # The prompt's text as the model reads it (template applied): the answer is a function of it
    # (simengine.tokens.answer_after), as a real model's is at temperature 0.
    context: bytes = b""
    # The answer is continued from text already in the prompt (an assistant message continued, or a
    # completion prompt): its first word is not an answer's first word.
    continued: bool = False
    priority: int = 0  # vLLM's: lower first, under --scheduling-policy priority

    @property
    def reason(self) -> str:
        return "length" if self.explicit else "stop"

    def usage(self, cached: int | None = None) -> dict:
        p = len(self.tokens)
        out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": self.max_tokens,
                               "total_tokens": p + self.max_tokens}
        if cached is not None:  # llama-server reports what it reused
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out


def model_of(body: dict, names: tuple[str, ...]) -> str:
    model = body.get("model") or names[0]
    if model not in names:
        raise BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")
    return model


def chat_prompt(messages: list, body: dict, prefill: str) -> tuple[list[int], bytes, bool]:
    """The prompt tokens, the context text and whether an assistant message is continued, as each
    engine reads a chat request: vLLM continues the last (assistant) message only when asked
    (`continue_final_message` with `add_generation_prompt: false`; both at once is its 400);
    llama-server continues a last assistant message always (its "assistant prefill", unless started
    with --no-prefill-assistant)."""
    cont = body.get("continue_final_message") is True
    if prefill == "vllm":
        if cont and body.get("add_generation_prompt", True) is not False:
            raise BadRequest(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                             "BadRequestError")
    else:
        cont = True
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    if cont and last.get("role") == "assistant":
        text = tok.content_text(last.get("content"))
        head = messages[:-1]
        return tok.chat_tokens(head) + tok.tokenize(text), tok.chat_context(head) + text.encode(), bool(text)
    if cont and prefill == "vllm":
        raise BadRequest(400, "continue_final_message is set but the last message is not the assistant's",
                         "BadRequestError")
    return tok.chat_tokens(messages), tok.chat_context(messages), False


def parse(chat: bool, body: dict, names: tuple[str, ...], max_tokens_default: int, prefill: str = "vllm") -> Job:
    model = model_of(body, names)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    explicit = mt is not None
    if mt is None:
        mt = max_tokens_default
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise BadRequest(400, "max_tokens must be a positive integer", "BadRequestError")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(400, "messages must be a non-empty list", "BadRequestError")
        tokens, context, continued = chat_prompt(messages, body, prefill)
    else:
        found = tok.prompt_tokens(body.get("prompt"))
        if found is None:
            raise BadRequest(400, "prompt must be a string (one prompt per request)", "BadRequestError")
        tokens, context, continued = found, tok.prompt_context(body.get("prompt")), True
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest(400, "cache_salt must be a non-empty string", "BadRequestError")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -2**63 <= priority < 2**63:
        raise BadRequest(400, "priority must be an integer", "BadRequestError")
    opts = body.get("stream_options") or {}
    return Job(chat, model, tokens, mt, explicit, bool(body.get("stream")),
               bool(isinstance(opts, dict) and opts.get("include_usage")), salt, context, continued, priority)


def whole(job: Job, ident: str, created: int, fingerprint: str, content: str, cached: int | None,
          timings: dict | None) -> dict:
    """A non-streamed answer."""
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": content, "tool_calls": []},
                  "logprobs": None, "finish_reason": job.reason}
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": job.reason}
    out = {"id": ident, "object": "chat.completion" if job.chat else "text_completion", "created": created,
           "model": job.model, "system_fingerprint": fingerprint, "choices": [choice], "usage": job.usage(cached)}
    if timings is not None:
        out["timings"] = timings
    return out


class Chunks:
    """The `data:` events of one streamed answer."""

    def __init__(self, job: Job, ident: str, created: int, fingerprint: str):
        self.job, self.ident, self.created, self.fingerprint = job, ident, created, fingerprint

    def _event(self, choices: list, usage: Any = None, extra: dict | None = None) -> bytes:
        d: dict[str, Any] = {"id": self.ident, "object": "chat.completion.chunk" if self.job.chat else "text_completion",
                             "created": self.created, "model": self.job.model,
                             "system_fingerprint": self.fingerprint, "choices": choices}
        if self.job.include_usage:
            d["usage"] = usage
        if extra:
            d.update(extra)
        return b"data: " + json.dumps(d).encode() + b"\n\n"

    def role(self, content: str | None = "") -> bytes:
        """The first chunk of a chat stream (vLLM: content "", llama-server: content null)."""
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                             "finish_reason": None}])

    def token(self, word: str, last: bool, timings: dict | None = None) -> bytes:
        fr = self.job.reason if last else None
        if self.job.chat:
            c = {"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": fr}
        else:
            c = {"index": 0, "text": word, "logprobs": None, "finish_reason": fr}
        return self._event([c], extra={"timings": timings} if timings is not None else None)

    def usage(self, cached: int | None) -> bytes:
        return self._event([], self.job.usage(cached))


def timings(prompt_n: int, cache_n: int, prompt_s: float, predicted_n: int, predicted_s: float) -> dict:
    """llama-server's per-answer `timings` (milliseconds; per-second rates over the processed part)."""
    pm, dm = prompt_s * 1000.0, predicted_s * 1000.0
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": pm,
            "prompt_per_token_ms": pm / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": dm,
            "predicted_per_token_ms": dm / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n / predicted_s if predicted_s > 0 else 0.0}


def render(job: Job, request_id: str) -> dict:
    """vLLM's /v1/chat/completions/render answer (a GenerateRequest): the prompt's token ids."""
    return {"request_id": request_id, "token_ids": job.tokens, "features": None,
            "sampling_params": {"max_tokens": job.max_tokens}, "model": job.model, "stream": False,
            "stream_options": None, "cache_salt": job.salt, "priority": job.priority, "kv_transfer_params": None}

