"""The common fields the gateway checks itself (gateway.request.fields): every bad one is a 400 in
OpenAI's shape with `param` naming it, whatever the operation's engine; good bodies pass untouched."""

from __future__ import annotations

import json

import pytest

from gateway.errors import TABLE, ApiError, error_body
from gateway.request.fields import check
from llmgw import surface as op

OK_CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}

# (operation, changes to a good chat body, code, param, words in the message)
BAD = [
    (op.CHAT, {"model": None}, "model_required", "model", "'model' is required"),
    (op.CHAT, {"model": ""}, "model_required", "model", "'model' is required"),
    (op.CHAT, {"model": 7}, "invalid_type", "model", "expected a string, but got an integer"),
    (op.CHAT, {"temperature": "0.5"}, "invalid_type", "temperature", "expected a decimal, but got a string"),
    (op.CHAT, {"temperature": True}, "invalid_type", "temperature", "expected a decimal, but got a boolean"),
    (op.CHAT, {"temperature": 2.5}, "invalid_value", "temperature", "above maximum value. Expected a value <= 2"),
    (op.CHAT, {"temperature": -0.1}, "invalid_value", "temperature", "below minimum value. Expected a value >= 0"),
    (op.CHAT, {"temperature": float("nan")}, "invalid_value", "temperature", "below minimum value"),
    (op.CHAT, {"top_p": 1.5}, "invalid_value", "top_p", "Expected a value <= 1"),
    (op.CHAT, {"top_p": [1]}, "invalid_type", "top_p", "but got an array"),
    (op.CHAT, {"max_tokens": 0}, "invalid_value", "max_tokens", "integer below minimum value"),
    (op.CHAT, {"max_tokens": 10.0}, "invalid_type", "max_tokens", "expected an integer, but got a decimal"),
    (op.CHAT, {"max_tokens": "10"}, "invalid_type", "max_tokens", "expected an integer, but got a string"),
    (op.CHAT, {"max_completion_tokens": -1}, "invalid_value", "max_completion_tokens", "Expected a value >= 1"),
    (op.CHAT, {"n": 0}, "invalid_value", "n", "Expected a value >= 1"),
    (op.CHAT, {"n": 129}, "invalid_value", "n", "Expected a value <= 128"),
    (op.CHAT, {"n": False}, "invalid_type", "n", "but got a boolean"),
    (op.CHAT, {"stream": "yes"}, "invalid_type", "stream", "expected a boolean, but got a string"),
    (op.CHAT, {"stream": 1}, "invalid_type", "stream", "expected a boolean, but got an integer"),
    (op.CHAT, {"stop": 5}, "invalid_type", "stop", "a string or an array of strings"),
    (op.CHAT, {"stop": ["a", 1]}, "invalid_type", "stop", "a string or an array of strings"),
    (op.CHAT, {"stream": True, "stream_options": "usage"}, "invalid_type", "stream_options", "expected an object"),
    (op.CHAT, {"stream": True, "stream_options": {"include_usage": "yes"}}, "invalid_type",
     "stream_options.include_usage", "expected a boolean"),
    (op.CHAT, {"stream_options": {"include_usage": True}}, "invalid_value", "stream_options",
     "only allowed when 'stream' is true"),
    (op.CHAT, {"stream": False, "stream_options": {}}, "invalid_value", "stream_options", "only allowed"),
    (op.CHAT, {"messages": "hi"}, "invalid_type", "messages", "expected an array of objects, but got a string"),
    (op.CHAT, {"messages": ["hi"]}, "invalid_type", "messages[0]", "expected an object"),
    (op.CHAT, {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "missing_required_parameter",
     "messages[1].role", "Missing required parameter: 'messages[1].role'"),
    (op.CHAT, {"messages": [{"role": 1, "content": "a"}]}, "invalid_type", "messages[0].role", "expected a string"),
    (op.CHAT, {"messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages[0].content",
     "a string or an array of content parts"),
    (op.COMPLETIONS, {"max_tokens": 0}, "invalid_value", "max_tokens", "Expected a value >= 1"),
    (op.COMPLETIONS, {"temperature": "hot"}, "invalid_type", "temperature", "expected a decimal"),
    (op.RESPONSES, {"max_output_tokens": 0}, "invalid_value", "max_output_tokens", "Expected a value >= 1"),
    (op.RESPONSES, {"stream": "no"}, "invalid_type", "stream", "expected a boolean"),
    (op.EMBEDDINGS, {"model": 3}, "invalid_type", "model", "expected a string"),
]


@pytest.mark.parametrize("operation, changes, code, param, words", BAD)
def test_a_bad_field_is_one_400_naming_it(operation, changes, code, param, words):
    body = {**OK_CHAT, **changes}
    with pytest.raises(ApiError) as got:
        check(body, operation)
    e = got.value
    assert e.status == 400 and e.param == param and words in e.message
    doc = error_body(e.kind, e.message, e.param)
    assert doc == {"error": {"message": e.message, "type": "invalid_request_error", "code": code, "param": param}}
    json.dumps(doc)  # what the client gets


@pytest.mark.parametrize("operation, changes", [
    (op.CHAT, {}),
    (op.CHAT, {"temperature": 0, "top_p": 1, "max_tokens": 1, "n": 128, "stream": False, "stop": "\n"}),
    (op.CHAT, {"temperature": 2.0, "top_p": 0.0, "max_completion_tokens": 5, "stop": [], "stream": True,
               "stream_options": {"include_usage": True}}),
    # null is "not set" (OpenAI's rule), also for stream_options without a stream
    (op.CHAT, {"temperature": None, "max_tokens": None, "stream": None, "stream_options": None, "stop": None}),
    (op.CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": []},
                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    (op.CHAT, {"logit_bias": {"1": "x"}, "seed": "s"}),  # fields not checked here are the engine's
    (op.CHAT, {"messages": []}),  # left to the engine, as a body without `messages` is
    (op.COMPLETIONS, {"prompt": 5, "max_tokens": 3}),
    (op.EMBEDDINGS, {"input": "x", "temperature": "any"}),  # an embedding has no sampling fields to check
    (op.RESPONSES, {"input": "hi", "max_output_tokens": 10, "temperature": 1}),
])
def test_good_bodies_pass(operation, changes):
    assert check({**OK_CHAT, **changes}, operation) is None


def test_the_model_is_checked_before_any_other_field():
    with pytest.raises(ApiError) as got:
        check({"messages": [], "temperature": "x"}, op.CHAT)
    assert got.value.kind == "missing_model" and got.value.param == "model"


def test_the_codes_are_in_the_one_table():
    codes = {code for _status, _type, code in TABLE.values()}
    assert {"invalid_type", "invalid_value", "missing_required_parameter", "model_required"} <= codes
    assert error_body("shed", "busy") == {"error": {"message": "busy", "type": "rate_limit_error", "code": "overloaded"}}
