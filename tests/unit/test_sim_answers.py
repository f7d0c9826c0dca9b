"""The simulated engine's answers are a function of the request, as a real model's at temperature 0:
the same on every replica, and an answer continued from its first k words (an assistant message
continued, a completion prompt extended) is the rest of it, word for word."""

from __future__ import annotations

import pytest

from simengine import openai as oa
from simengine import tokens as tok

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def test_an_answer_depends_on_the_request_only():
    a = tok.answer_after(tok.chat_context(MSGS), 12, False, "0:")
    assert a == tok.answer_after(tok.chat_context(MSGS), 12, False, "0:")
    assert a != tok.answer_after(tok.chat_context(MSGS[1:]), 12, False, "0:")
    assert a != tok.answer_after(tok.chat_context(MSGS), 12, False, "1:")  # another seed: other weights
    assert a[0] in tok.FIRST_WORDS and all(len(w.encode()) == 4 for w in a)


@pytest.mark.parametrize("k", [1, 5, 11])
def test_a_continued_answer_is_the_rest_of_it(k):
    whole = tok.answer_after(tok.chat_context(MSGS), 12, False, "0:", "[a1] ")
    head = "".join(whole[:k])
    rest = tok.answer_after(tok.chat_context(MSGS) + head.encode(), 12 - k, True, "0:", "[a1] ")
    assert whole[:k] + rest == whole


def body(**kw):
    return {"model": "m", "messages": MSGS + [{"role": "assistant", "content": "sure the"}], **kw}


def test_vllm_continues_the_last_message_only_when_asked():
    job = oa.parse(True, body(continue_final_message=True, add_generation_prompt=False), ("m",), 16, "vllm")
    assert job.continued and job.context == tok.chat_context(MSGS) + b"sure the"
    assert job.tokens == tok.chat_tokens(MSGS) + tok.tokenize("sure the")
    plain = oa.parse(True, body(), ("m",), 16, "vllm")  # a new turn after the assistant's message
    assert not plain.continued and plain.context == tok.chat_context(body()["messages"])
    with pytest.raises(oa.BadRequest, match="Cannot set both"):
        oa.parse(True, body(continue_final_message=True), ("m",), 16, "vllm")


def test_llamacpp_prefills_a_last_assistant_message():
    job = oa.parse(True, body(), ("m",), 16, "llamacpp")
    assert job.continued and job.context == tok.chat_context(MSGS) + b"sure the"
    new = oa.parse(True, {"model": "m", "messages": MSGS}, ("m",), 16, "llamacpp")
    assert not new.continued and new.context == tok.chat_context(MSGS)


def test_a_completion_continues_its_prompt():
    job = oa.parse(False, {"model": "m", "prompt": "abc"}, ("m",), 16)
    words = tok.answer_after(job.context, 6, job.continued)
    more = oa.parse(False, {"model": "m", "prompt": "abc" + "".join(words[:2])}, ("m",), 16)
    assert words[:2] + tok.answer_after(more.context, 4, more.continued) == words
