"""Resuming a stream whose engine broke off, on another replica: the decisions, pure, on bytes and dicts.

The shell (gateway.http.resume) passes the engine's stream on as before and keeps each piece it sent;
when the stream breaks (the connection reset or closed without the answer's end, an error event, no
token within the stall limit), these functions say what happens:

- `fold` reads what the client was sent into `Said` (the answer's text so far, the tokens that
  carried it, whether it had ended). The shell folds only every FOLD_PIECES pieces (to bound what a
  stream holds) and at a break: per piece it only appends, so a stream that never breaks costs no
  parsing.
- `decide` says what to do with a stream: `Resume` with the request that continues the answer
  (`continuation`), `Finish` (the answer had ended: close it as the engine would have), or `Cut`
  with the reason, sent as an OpenAI-shaped error event (`cut_event`) where a resume could not be
  exact. `ask_again` says it for a whole answer, of which the client was sent nothing yet.
- `Splice` rewrites the continuing stream's events so the client sees one answer: its first id and
  creation time, no second role chunk, the usage counted once (the prompt without the resent text,
  the completion with it).

How each engine continues an answer (checked in their sources): vLLM's chat endpoint with
`continue_final_message: true` and `add_generation_prompt: false` renders the last (assistant)
message open-ended and generates after it; llama-server's chat endpoint does the same for a last
assistant message by default (its "assistant prefill": the template applied to the messages before
it with the generation prompt, then the message's text appended; `--no-prefill-assistant` turns it
off) and ignores the vLLM fields. So one body serves both. A completion continues by extending its
prompt with the text so far, on every engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmgw import surface as op

RESUMABLE_OPS = frozenset({op.CHAT, op.COMPLETIONS})
STREAMED_OPS = frozenset({op.CHAT, op.COMPLETIONS, op.RESPONSES})
# Pieces a stream holds before folding them into its Said: a 256-token answer of vLLM's or
# llama-server's (an event a piece, ~200 bytes) is never folded before it ends; a longer one holds
# ~50 KB at most and pays a little per event for the fold (`python -m bench.resume --per-piece`).
FOLD_PIECES = 256

# Engines write compact JSON (vLLM's pydantic, llama-server's nlohmann); the simulated engine writes
# Python's json.dumps, with a space after the colon. Inside a JSON string every quote is escaped,
# so `"key":` never matches text within a value.
_STRING = rb'"([^"\\]*(?:\\.[^"\\]*)*)"'
CONTENT = re.compile(rb'"content": ?' + _STRING)
TEXT = re.compile(rb'"text": ?' + _STRING)
DELTA = re.compile(rb'"delta": ?' + _STRING)
REASONING = re.compile(rb'"reasoning(?:_content)?": ?"[^"]')
TOOLS = re.compile(rb'"tool_calls": ?\[ ?\{')
FINISH = re.compile(rb'"finish_reason": ?"')
USAGE = re.compile(rb'"usage": ?\{')
EVENT_TYPE = re.compile(rb'"type": ?"([a-z_.]+)"')
ID = re.compile(rb'"id": ?' + _STRING)
CREATED = re.compile(rb'"created": ?(\d+)')
DONE = b"data: [DONE]"
RESPONSE_ENDS = (b"response.completed", b"response.incomplete", b"response.failed")
# An engine's error event mid-stream: vLLM's `data: {"error": {...}}`, llama-server's `error: {...}`
# line. The shell looks for this in each piece (one substring search); `error_at` confirms.
ERROR_MARK = b"error"

# Request fields whose answer cannot be continued exactly from its text (why, for the error event).
CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
               "grammar", "json_schema")


@dataclass(frozen=True)
class Said:
    """What the client was sent of one answer (its first choice; n > 1 is never resumed)."""

    text: bytes = b""  # the answer's text so far, JSON-escaped as the engine wrote it
    tokens: int = 0  # the events that carried text: one token each on vLLM and llama-server
    reasoning: bool = False  # reasoning text was sent (vLLM's reasoning parser, llama-server's)
    tools: bool = False  # a tool call was sent (its arguments may be cut)
    finished: bool = False  # the answer's end was sent (a finish_reason; a Responses stream's last event)
    done: bool = False  # `data: [DONE]` was sent
    other: bool = False  # a Responses stream sent output other than one message's text

    @property
    def content(self) -> str:
        """The text, decoded."""
        return json.loads(b'"' + self.text + b'"') if self.text else ""


def fold(route_op: str, said: Said, data: bytes, last: bool = True) -> Said:
    """`said` after the client was also sent `data` (whole lines: the stream's rewrite holds a line
    until it is complete). `last`: `data` ends what was sent (the stream broke); the answer's end is
    only looked for then, since nothing but the usage and `[DONE]` follows it."""
    if not data:
        return said
    if route_op == op.RESPONSES:
        return _fold_responses(said, data)
    found = (CONTENT if route_op == op.CHAT else TEXT).findall(data)
    pieces = [f for f in found if f]
    # What is rare is looked for as bytes first (a C search); only a hit runs its expression.
    reasoning = said.reasoning or (b'"reasoning' in data and REASONING.search(data) is not None)
    tools = said.tools or (b'"tool_calls' in data and TOOLS.search(data) is not None)
    return Said(said.text + b"".join(pieces), said.tokens + len(pieces), reasoning, tools,
                said.finished or (last and FINISH.search(data) is not None), said.done or DONE in data)


def _fold_responses(said: Said, data: bytes) -> Said:
    text, tokens, finished, other = [said.text], said.tokens, said.finished, said.other
    for line in data.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        m = EVENT_TYPE.search(line)
        kind = m.group(1) if m else b""
        if kind == b"response.output_text.delta":
            d = DELTA.search(line)
            if d and d.group(1):
                text.append(d.group(1))
                tokens += 1
        elif kind in RESPONSE_ENDS:
            finished = True
        elif kind.endswith(b".delta") or (kind == b"response.output_item.added" and b'"message"' not in line):
            other = True  # reasoning, a function call's arguments, another item
    return Said(b"".join(text), tokens, said.reasoning, said.tools, finished, said.done, other)


def error_at(data: bytes) -> int:
    """Where an engine's error event starts in `data` (a piece about to be sent), or -1: a `data:`
    line whose JSON is an object with `error` first, or llama-server's `error:` line."""
    for line_start in _line_starts(data):
        line = data[line_start:line_start + 16]
        if line.startswith(b"error: {") or line.replace(b" ", b"").startswith(b'data:{"error"'):
            return line_start
    return -1


def _line_starts(data: bytes):
    yield 0
    at = data.find(b"\n")
    while at >= 0:
        yield at + 1
        at = data.find(b"\n", at + 1)


def ended(route_op: str, tail: bytes) -> bool:
    """Whether a stream whose body ended with `tail` (its last pieces) ended its answer: `[DONE]`
    (chat, completions), or a Responses stream's last event."""
    if route_op == op.RESPONSES:
        return any(e in tail for e in RESPONSE_ENDS)
    return DONE in tail


# --- what to do at a break ------------------------------------------------------------------------
@dataclass(frozen=True)
class Resume:
    """Send `body` (the client's request, continued) to another replica and splice its stream in."""

    body: dict


@dataclass(frozen=True)
class Finish:
    """The answer needs no more tokens: end it as the engine would have (`reason`: the finish_reason
    to send first, when the engine had not; `done`: send `data: [DONE]`)."""

    reason: str | None
    done: bool


@dataclass(frozen=True)
class Cut:
    """End the stream with an error event: `code` (stream_resume_refused | stream_resume_failed) and why."""

    code: str
    reason: str


def refusal(route_op: str, body: dict, said: Said) -> str | None:
    """Why the answer cannot be continued exactly from its text, or None."""
    if route_op not in RESUMABLE_OPS:
        return "a Responses stream is not resumed (its engine stores the response being written)"
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return "n > 1: the other choices' text would not be replayed"
    if body.get("logprobs") or body.get("top_logprobs"):
        return "logprobs were asked for: the resent text's would be missing"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return f"constrained output (response_format {fmt.get('type')}) restarts its grammar on the new replica"
    for k in CONSTRAINTS:
        if body.get(k) is not None:
            return f"constrained output ({k}) restarts its grammar on the new replica"
    if said.tools:
        return "a tool call was being sent: its arguments may be cut"
    if said.reasoning:
        return "reasoning text was being sent: the chat template decides how it is read back"
    if route_op == op.COMPLETIONS:
        if body.get("echo"):
            return "echo: the prompt was sent as part of the answer"
        if body.get("suffix") is not None:
            return "a suffix (fill in the middle) cannot be continued"
        best = body.get("best_of")
        if isinstance(best, int) and not isinstance(best, bool) and best > 1:
            return "best_of > 1 chooses among whole answers"
        if _prompt_text(body.get("prompt")) is None:
            return "the prompt is not one text (token ids, or several prompts)"
    elif not isinstance(body.get("messages"), list) or not body["messages"]:
        return "the request has no messages"
    return None


def decide(route_op: str, body: dict, said: Said, hops: int, limit: int, off: str | None = None
           ) -> Resume | Finish | Cut:
    """What to do when the stream of `body` breaks after `said` was sent and `hops` resumes: `off`
    says why resuming is off for it (the model's catalog switch, the gateway's setting)."""
    n = body.get("n")
    if said.finished and not (isinstance(n, int) and n > 1):  # n > 1: one choice ended, maybe not all
        return Finish(None, not said.done and route_op != op.RESPONSES)
    if off is not None:
        return Cut("stream_resume_refused", off)
    why = refusal(route_op, body, said)
    if why is not None:
        return Cut("stream_resume_refused", why)
    if hops >= limit:
        return Cut("stream_resume_failed", f"the stream broke {hops + 1} times; at most {limit} resumes per "
                                           "request (LLMGW_GATEWAY_RESUMES)")
    budget = remaining(body, said.tokens)
    if budget is not None and budget <= 0:
        return Finish("length", True)
    return Resume(continuation(route_op, body, said))


def ask_again(status: int, hops: int, limit: int, off: str | None, client_gone: bool) -> bool:
    """Whether a whole (not streamed) answer whose engine broke off while its body was read is asked
    for again on another endpoint: nothing of it reached the client, so the request goes again as it
    was, unless the engine's answer was an error already (`status`), the client left, resuming is
    `off` for it, or it was asked again `limit` times (LLMGW_GATEWAY_RESUMES) already."""
    return status < 400 and not client_gone and off is None and hops < limit


MAX_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict")


def remaining(body: dict, sent: int) -> int | None:
    """The tokens the answer may still have (None: no limit asked)."""
    for k in MAX_FIELDS:
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v - sent
    return None


def continuation(route_op: str, body: dict, said: Said) -> dict:
    """The request that continues the answer after `said`: the text so far as the start of the
    assistant's answer (chat) or the end of the prompt (completions), each limit reduced by the
    tokens sent."""
    out = dict(body)
    for k in (*MAX_FIELDS, "min_tokens"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            out[k] = max(0 if k == "min_tokens" else 1, v - said.tokens)
    text = said.content
    if route_op == op.COMPLETIONS:
        out["prompt"] = _prompt_text(body.get("prompt")) + text
        return out
    if not text:
        return out  # nothing of the answer was sent: the request as it was
    messages = list(body["messages"])
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    if last.get("role") == "assistant":
        # The client itself started the answer (a prefill): the text continues that message.
        messages[-1] = {**last, "content": _appended(last.get("content"), text)}
    else:
        messages.append({"role": "assistant", "content": text})
    out["messages"] = messages
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    return out


def _appended(content: Any, text: str) -> Any:
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return (content if isinstance(content, str) else "") + text


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


# --- what the client is sent ----------------------------------------------------------------------
def separator(last: bytes) -> bytes:
    """What completes the event the client was last sent, so the next one stands alone: the stream's
    pieces end with whole lines, but an event's blank line may not have come."""
    if last.endswith(b"\n\n") or not last:
        return b""
    return b"\n" if last.endswith(b"\n") else b"\n\n"


def head_of(first: bytes) -> tuple[str, int | None]:
    """The id and creation time of the answer, from the first event the client was sent."""
    m, c = ID.search(first), CREATED.search(first)
    return (json.loads(b'"' + m.group(1) + b'"') if m else ""), (int(c.group(1)) if c else None)


def finish_events(route_op: str, head: tuple[str, int | None], model: str, f: Finish) -> bytes:
    """The end of an answer whose engine broke off after its last token."""
    out = b""
    if f.reason is not None and route_op in RESUMABLE_OPS:
        chat = route_op == op.CHAT
        choice: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": f.reason} if chat
                                  else {"index": 0, "text": "", "logprobs": None, "finish_reason": f.reason})
        event = {"id": head[0], "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": head[1] or 0, "model": model, "choices": [choice]}
        out += b"data: " + json.dumps(event).encode() + b"\n\n"
    if f.done:
        out += DONE + b"\n\n"
    return out


def cut_event(route_op: str, cut: Cut, sequence: int = 0) -> bytes:
    """An OpenAI-shaped error event that ends a stream that cannot go on: chat and completions as
    vLLM writes one (`data: {"error": ...}`), a Responses stream its `error` event. No `[DONE]`
    follows, and the shell then closes the connection without HTTP's last chunk: a client reading
    events sees the error, one reading the body sees it cut, neither takes the answer as whole."""
    message = f"the engine stopped mid-answer and the stream was not resumed: {cut.reason}"
    if route_op == op.RESPONSES:
        data = {"type": "error", "code": cut.code, "message": message, "param": None, "sequence_number": sequence}
        return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
    data = {"error": {"message": message, "type": "server_error", "param": None, "code": cut.code}}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


class Splice:
    """The continuing stream, rewritten line by line to continue the client's: `chunk(data)` per
    receive (an incomplete last line is held until the next), `end()` when it ends."""

    __slots__ = ("chat", "ident", "created", "resent", "held")

    def __init__(self, route_op: str, head: tuple[str, int | None], resent: int):
        self.chat = route_op == op.CHAT
        self.ident, self.created = head
        self.resent = resent  # tokens of the answer the new engine read as prompt
        self.held = b""

    def chunk(self, data: bytes) -> bytes:
        data = self.held + data if self.held else data
        nl = data.rfind(b"\n")
        if nl < 0:
            self.held = data
            return b""
        data, self.held = data[:nl + 1], data[nl + 1:]
        return b"".join(self._line(line) for line in data.splitlines(keepends=True))

    def end(self) -> bytes:
        held, self.held = self.held, b""
        return self._line(held) if held else b""

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:"):
            return line
        text = line[5:].strip()
        if not text.startswith(b"{"):
            return line  # [DONE]
        try:
            event = json.loads(text)
        except ValueError:
            return line
        if not isinstance(event, dict) or "error" in event:
            return line
        if self.chat and _role_only(event):
            return b""  # the client had its role chunk; the blank line after this one stays (harmless)
        for c in event.get("choices") or ():
            delta = c.get("delta") if isinstance(c, dict) else None
            if isinstance(delta, dict):
                delta.pop("role", None)
        if self.ident:
            event["id"] = self.ident
        if self.created is not None and "created" in event:
            event["created"] = self.created
        usage = event.get("usage")
        if isinstance(usage, dict):
            event["usage"] = spliced_usage(usage, self.resent)
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + (b"\n" if line.endswith(b"\n") else b"")


def _role_only(event: dict) -> bool:
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    c = choices[0]
    delta = c.get("delta")
    return (isinstance(delta, dict) and "role" in delta and not delta.get("content") and not delta.get("tool_calls")
            and not delta.get("reasoning_content") and c.get("finish_reason") is None and not event.get("usage"))


def spliced_usage(usage: dict, resent: int) -> dict:
    """The continuing engine's usage as the whole answer's: the resent tokens move from its prompt to
    the completion (the total stays what the engines computed)."""
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(p, int) or not isinstance(c, int):
        return usage
    moved = min(resent, p)
    out = {**usage, "prompt_tokens": p - moved, "completion_tokens": c + moved}
    return out
