"""gateway.upstream.assemble: the whole answer a llama.cpp endpoint would have sent, built from the
stream the gateway asked it for (however the stream's bytes were split): text, tool calls,
finish_reason, usage and timings kept; an error event becomes the error."""

from __future__ import annotations

import json

from gateway.upstream.assemble import Assembler


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def chunk(delta, finish=None, **top):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "default",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **top}


CHAT = sse(
    chunk({"role": "assistant", "content": None}),
    chunk({"content": "Hel"}), chunk({"content": "lo"}),
    chunk({}, "length", timings={"cache_n": 3, "predicted_n": 2}),
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "default", "choices": [],
     "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}},
    b"[DONE]",
)


def assembled(stream: bytes, size: int, chat: bool = True) -> tuple[int, dict]:
    asm = Assembler(chat)
    for i in range(0, len(stream), size):
        asm.feed(stream[i:i + size])
    status, body = asm.result()
    return status, json.loads(body)


def test_a_chat_stream_becomes_the_whole_answer_however_it_is_split():
    for size in (1, 5, 33, len(CHAT)):
        status, doc = assembled(CHAT, size)
        assert status == 200
        assert doc == {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "default",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                    "logprobs": None, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
                       "timings": {"cache_n": 3, "predicted_n": 2}}


def test_tool_calls_are_merged_by_index_and_their_arguments_joined():
    stream = sse(
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "now", "arguments": "{}"}}]}),
        chunk({"reasoning_content": "think"}),
        chunk({}, "tool_calls"), b"[DONE]")
    _, doc = assembled(stream, 17)
    msg = doc["choices"][0]["message"]
    assert doc["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["content"] is None and msg["reasoning_content"] == "think"
    assert msg["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_a_completions_stream_and_its_logprobs():
    ev = lambda text, lp, fin=None: {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",  # noqa: E731
                                     "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": fin}]}
    stream = sse(ev("a", {"tokens": ["a"], "token_logprobs": [-0.1]}),
                 ev("b", {"tokens": ["b"], "token_logprobs": [-0.2]}, "stop"), b"[DONE]")
    status, doc = assembled(stream, 9, chat=False)
    assert status == 200 and doc["object"] == "text_completion"
    assert doc["choices"] == [{"index": 0, "text": "ab", "finish_reason": "stop",
                               "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2]}}]


def test_an_error_event_is_the_answer_and_nothing_at_all_is_a_502():
    status, doc = assembled(sse(chunk({"content": "x"}), {"error": {"code": 500, "message": "boom"}}), 4)
    assert status == 500 and doc == {"error": {"code": 500, "message": "boom"}}
    status, doc = assembled(b": just a comment\n\n", 4)
    assert status == 502 and doc["error"]["code"] == "upstream_error"


def test_a_last_line_without_its_newline_still_counts():
    status, doc = assembled(sse(chunk({"content": "hi"}, "stop")).rstrip(b"\n"), 6)
    assert status == 200 and doc["choices"][0]["message"]["content"] == "hi"
