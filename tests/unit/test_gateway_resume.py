"""gateway.upstream.resume: what the client was sent, whether a broken stream resumes, the request that
continues it, and the continuing stream spliced into the client's. Pure: bytes and dicts."""

from __future__ import annotations

import json

import pytest

from gateway.upstream import resume as rs
from llmgw import surface as op


def chat_event(content=None, role=None, finish=None, compact=True, **extra) -> bytes:
    delta = {}
    if role is not None:
        delta["role"] = role
    if content is not None or role is not None:
        delta["content"] = content
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(event, separators=(",", ":") if compact else None).encode() + b"\n\n"


def text_event(text, finish=None) -> bytes:
    event = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


@pytest.mark.parametrize("compact", [True, False])
def test_fold_reads_the_text_sent_and_counts_its_tokens(compact):
    sent = chat_event(role="assistant", content="", compact=compact) + b"".join(
        chat_event(w, compact=compact) for w in ["Hel", "lo, \"wor", "ld\" \u00e9", "\\n"])
    said = rs.fold(op.CHAT, rs.Said(), sent)
    assert said.content == 'Hello, "world" \u00e9\\n' and said.tokens == 4
    assert not (said.finished or said.done or said.tools or said.reasoning)
    # folded in two parts, the same
    half = len(sent) // 2
    cut = sent.rfind(b"\n", 0, half) + 1
    again = rs.fold(op.CHAT, rs.fold(op.CHAT, rs.Said(), sent[:cut]), sent[cut:])
    assert again == said


def test_fold_sees_the_end_tool_calls_and_reasoning():
    end = rs.fold(op.CHAT, rs.Said(), chat_event("x") + chat_event(finish="length") + b"data: [DONE]\n\n")
    assert end.finished and end.done
    tool = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":"}}
    ev = b'data: {"id":"c","choices":[{"index":0,"delta":{"tool_calls":[' + json.dumps(tool).encode() + b']}}]}\n\n'
    assert rs.fold(op.CHAT, rs.Said(), ev).tools
    assert rs.fold(op.CHAT, rs.Said(), b'data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}\n\n').reasoning
    # text that merely mentions the keys is text
    said = rs.fold(op.CHAT, rs.Said(), chat_event('"tool_calls":[{ "finish_reason":"x"'))
    assert not said.tools and not said.finished and said.content == '"tool_calls":[{ "finish_reason":"x"'


def test_fold_completions_and_responses():
    said = rs.fold(op.COMPLETIONS, rs.Said(), text_event(" a") + text_event(" b"))
    assert said.content == " a b" and said.tokens == 2
    ev = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "hi"}\n\n'
    done = b'event: response.completed\ndata: {"type": "response.completed", "response": {}}\n\n'
    said = rs.fold(op.RESPONSES, rs.Said(), ev + ev)
    assert said.content == "hihi" and said.tokens == 2 and not said.finished
    assert rs.fold(op.RESPONSES, said, done).finished


def test_error_events_are_found_where_they_start():
    ok = chat_event("x")
    assert rs.error_at(ok) == -1
    assert rs.error_at(ok + b'data: {"error": {"message": "boom"}}\n\n') == len(ok)
    assert rs.error_at(ok + b'error: {"code":500}\n\n') == len(ok)
    assert rs.error_at(chat_event('{"error": x')) == -1  # text that looks like one is escaped


def test_a_stream_ended_only_with_its_last_event():
    assert rs.ended(op.CHAT, chat_event(finish="stop") + b"data: [DONE]\n\n")
    assert not rs.ended(op.CHAT, chat_event("x"))
    assert rs.ended(op.RESPONSES, b'data: {"type": "response.completed"}\n\n')


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}


def test_decide_resumes_with_the_text_as_the_assistants_start():
    said = rs.Said(text=b"Hello wo", tokens=3)
    step = rs.decide(op.CHAT, BODY, said, 0, 2)
    assert isinstance(step, rs.Resume)
    body = step.body
    assert body["messages"] == [*BODY["messages"], {"role": "assistant", "content": "Hello wo"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 7 and body["stream"] is True
    assert BODY["max_tokens"] == 10 and len(BODY["messages"]) == 1  # the client's body is untouched


def test_a_client_prefill_is_continued_not_doubled():
    body = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "Sure: "}],
            "continue_final_message": True, "add_generation_prompt": False}
    out = rs.continuation(op.CHAT, body, rs.Said(text=b"one", tokens=1))
    assert out["messages"][-1] == {"role": "assistant", "content": "Sure: one"} and len(out["messages"]) == 2


def test_nothing_sent_yet_resends_the_request_as_it_was():
    assert rs.decide(op.CHAT, BODY, rs.Said(), 0, 2) == rs.Resume(BODY)


def test_completions_extend_their_prompt():
    body = {"model": "m", "prompt": "Once", "max_tokens": 5, "min_tokens": 4}
    out = rs.continuation(op.COMPLETIONS, body, rs.Said(text=b" upon", tokens=1))
    assert out["prompt"] == "Once upon" and out["max_tokens"] == 4 and out["min_tokens"] == 3


@pytest.mark.parametrize("change, said, why", [
    ({"n": 2}, rs.Said(), "n > 1"),
    ({"logprobs": True}, rs.Said(), "logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, rs.Said(), "constrained"),
    ({"guided_json": {}}, rs.Said(), "constrained"),
    ({}, rs.Said(text=b"x", tools=True), "tool call"),
    ({}, rs.Said(reasoning=True), "reasoning"),
])
def test_what_cannot_be_resumed_exactly_is_cut_with_the_reason(change, said, why):
    step = rs.decide(op.CHAT, {**BODY, **change}, said, 0, 2)
    assert isinstance(step, rs.Cut) and step.code == "stream_resume_refused" and why in step.reason
    assert rs.refusal(op.COMPLETIONS, {"prompt": [1, 2]}, rs.Said()).startswith("the prompt is not one text")
    assert "Responses" in rs.refusal(op.RESPONSES, {}, rs.Said())


def test_the_bound_the_switch_and_an_ended_answer():
    said = rs.Said(text=b"x", tokens=1)
    assert rs.decide(op.CHAT, BODY, said, 2, 2) == rs.Cut(
        "stream_resume_failed", "the stream broke 3 times; at most 2 resumes per request (LLMGW_GATEWAY_RESUMES)")
    assert rs.decide(op.CHAT, BODY, said, 0, 2, off="off here") == rs.Cut("stream_resume_refused", "off here")
    assert rs.decide(op.CHAT, BODY, rs.Said(finished=True), 0, 2, off="x") == rs.Finish(None, True)
    assert rs.decide(op.CHAT, BODY, rs.Said(finished=True, done=True), 0, 2) == rs.Finish(None, False)
    assert rs.decide(op.CHAT, BODY, rs.Said(text=b"x", tokens=10), 0, 2) == rs.Finish("length", True)


def test_finish_and_cut_events():
    out = rs.finish_events(op.CHAT, ("chatcmpl-1", 7), "m", rs.Finish("length", True))
    first, done, _ = out.split(b"\n\n")
    assert json.loads(first[6:])["choices"][0]["finish_reason"] == "length" and done == b"data: [DONE]"
    ev = rs.cut_event(op.CHAT, rs.Cut("stream_resume_refused", "why"))
    err = json.loads(ev[6:])["error"]
    assert err["code"] == "stream_resume_refused" and err["message"].endswith(": why") and ev.endswith(b"\n\n")
    assert rs.cut_event(op.RESPONSES, rs.Cut("c", "why")).startswith(b"event: error\ndata: {\"type\": \"error\"")


def test_separator_completes_the_last_event():
    assert rs.separator(b"data: x\n\n") == b"" and rs.separator(b"data: x\n") == b"\n"
    assert rs.separator(b"data: x") == b"\n\n" and rs.separator(b"") == b""


def test_splice_keeps_one_id_one_role_and_counts_the_prompt_once():
    s = rs.Splice(op.CHAT, ("chatcmpl-first", 5), 3)
    new = (chat_event(role="assistant", content="") + chat_event(" next") + chat_event(finish="length")
           + b'data: {"id":"chatcmpl-2","choices":[],"usage":{"prompt_tokens":13,"completion_tokens":7,'
             b'"total_tokens":20}}\n\n' + b"data: [DONE]\n\n")
    pieces = [new[i:i + 37] for i in range(0, len(new), 37)]  # split anywhere
    out = b"".join(s.chunk(p) for p in pieces) + s.end()
    evs = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert [e["id"] for e in evs] == ["chatcmpl-first"] * 3 and all(e.get("created", 5) == 5 for e in evs)
    assert not any("role" in c.get("delta", {}) for e in evs for c in e["choices"])
    assert evs[0]["choices"][0]["delta"] == {"content": " next"}
    assert evs[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
    assert out.endswith(b"data: [DONE]\n\n")


def test_head_of_the_first_event():
    assert rs.head_of(chat_event("x")) == ("chatcmpl-1", 7)
    assert rs.head_of(b"") == ("", None)


def test_a_continuation_avoids_a_retiring_endpoint_while_another_can_serve_it():
    """An answer resumed after a break or an eviction: on a replica a rolling update is replacing it
    would break again under that replica's drain."""
    from dataclasses import replace

    from gateway.routing.choice import RouteRequest, eligible
    from llmgw.state.records import EndpointInfo

    def ep(i):
        return EndpointInfo(id=i, url=f"http://{i}", models=("m",), engine="sim", served_name="m", model="m")

    old, new = replace(ep("old"), retiring=True), ep("new")
    assert [e.id for e in eligible([old, new], RouteRequest("m", continuation=True), {}, 0.0)] == ["new"]
    assert [e.id for e in eligible([old, new], RouteRequest("m"), {}, 0.0)] == ["old", "new"]  # new work: both
    # the only one left: it still serves the continuation
    assert [e.id for e in eligible([old], RouteRequest("m", continuation=True), {}, 0.0)] == ["old"]
    assert [e.id for e in eligible([old, new], RouteRequest("m", continuation=True, exclude=frozenset({"new"})),
                                   {}, 0.0)] == ["old"]
