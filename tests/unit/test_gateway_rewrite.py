"""gateway.upstream.rewrite: an answer names the model the client asked for, in whole bodies and in
streams whose events arrive split across receives; nothing else changes."""

from __future__ import annotations

import json

from gateway.response_ids import IdRewrite, wrap
from gateway.upstream.rewrite import MAX_HELD, AnswerRewrite, escaped_name, rename_model

LLAMA_CHUNK = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hi"}}],'
               b'"created":1,"id":"chatcmpl-x","model":"default","object":"chat.completion.chunk"}\n\n')


def events(stream: bytes) -> list[dict]:
    return [json.loads(line[5:]) for line in stream.split(b"\n") if line.startswith(b"data: {")]


def test_a_whole_answer_names_the_client_model_and_keeps_every_other_byte():
    body = b'{"id":"c1","model":"default","choices":[{"message":{"content":"a \\"model\\": \\"x\\""}}]}'
    out = AnswerRewrite("smollm2").body(body)
    assert out == body.replace(b'"model":"default"', b'"model":"smollm2"')
    assert json.loads(out)["choices"][0]["message"]["content"] == 'a "model": "x"'  # a string's text stays


def test_spaces_nested_keys_and_odd_names():
    body = json.dumps({"model": "sim", "response": {"model": "sim", "x": 1}, "data": [0.1]}).encode()
    doc = json.loads(AnswerRewrite('my "lora"/é').body(body))
    assert doc["model"] == doc["response"]["model"] == 'my "lora"/é'
    assert doc["data"] == [0.1]


def test_nothing_is_copied_when_the_model_already_matches_or_is_absent():
    same = b'data: {"model":"smollm2","x":1}\n\n'
    assert rename_model(same, escaped_name("smollm2")) is same
    none = b'data: [DONE]\n\n'
    assert rename_model(none, escaped_name("smollm2")) is none
    odd = b'{"model": null, "model": 3}'  # not strings: left alone
    assert rename_model(odd, escaped_name("m")) == odd


def test_a_stream_split_anywhere_comes_out_renamed_and_whole():
    stream = LLAMA_CHUNK * 3 + b": keep-alive comment\n\n" + b"data: [DONE]\n\n"
    want = stream.replace(b'"model":"default"', b'"model":"smollm2"')
    for size in (1, 7, 13, 40, 64, len(LLAMA_CHUNK) - 1, len(LLAMA_CHUNK) + 5, len(stream)):
        rw = AnswerRewrite("smollm2")
        pieces = [stream[i:i + size] for i in range(0, len(stream), size)]
        out = list(rw.stream(pieces))
        assert b"".join(out) == want, size
        assert all(out), "no empty piece is passed on"
        assert all(p.endswith(b"\n") for p in out)  # only whole lines leave


def test_a_stream_that_ends_without_a_newline_is_passed_on_at_its_end():
    rw = AnswerRewrite("m")
    assert rw.chunk(b'data: {"model":"x"}\n\ndata: {"mod') == b'data: {"model":"m"}\n\n'
    assert rw.chunk(b'el":"x"}') == b""
    assert rw.end() == b'data: {"model":"m"}'
    assert rw.end() == b""


def test_a_line_too_long_to_be_an_event_is_not_held():
    big = b"x" * (MAX_HELD + 1)
    assert AnswerRewrite("m").chunk(big) == big


def test_with_response_ids_both_rewrites_apply():
    ids = IdRewrite("e1", learn=True)
    rw = AnswerRewrite("smol", ids)
    event = b'data: {"type":"response.created","response":{"id":"resp_1","model":"sim"}}\n\n'
    half = len(event) // 2
    out = rw.chunk(event[:half]) + rw.chunk(event[half:])
    doc = events(out)[0]["response"]
    assert doc == {"id": wrap("e1", "resp_1"), "model": "smol"}
