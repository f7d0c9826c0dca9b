"""The common fields of a request, checked by the gateway itself: `check(body, op)` raises the one
400 every engine's client then sees, in OpenAI's shape and words, with `param` naming the field.
Pure (docs/gateway.md#bad-fields).

Without it a string `temperature` was llama.cpp's JSON library talking ("[json.exception.type_error.302]
type must be number, but is string"), vLLM's pydantic, or the simulator's own words, and a client could
not tell one field's mistake from another's. Only types and ranges every OpenAI-compatible engine
shares are checked here; what one engine cannot do (llama.cpp's `n` > 1, a prompt longer than the
context) is still its own answer, put in the gateway's shape by gateway.errors.engine_error.

    model                                    a non-empty string (every JSON operation)
    messages                                 an array of objects, each with a string `role` and a
                                             `content` that is a string, an array or null
    max_tokens, max_completion_tokens,       an integer >= 1
    max_output_tokens
    temperature                              a number in [0, 2]
    top_p                                    a number in [0, 1]
    n                                        an integer in [1, 128]
    stream                                   a boolean
    stop                                     a string or an array of strings
    stream_options                           an object (`include_usage` a boolean), only with "stream": true

A field set to null is not set (OpenAI's rule). Not checked here: whether `messages` is there at all
or empty, `prompt`, and the engine-specific fields; an engine's refusal of those comes in the gateway's
shape (gateway.errors.engine_error), in its own words. Its cost is a few dictionary lookups per request: the
loop runs over the body's own keys, so an absent field costs nothing (`python -m bench.hotpath`).
"""

from __future__ import annotations

from typing import Callable

from gateway.errors import ApiError
from llmgw import surface as op

MAX_N = 128  # OpenAI's upper bound for `n`


def _what(v) -> str:
    """A JSON value's type in OpenAI's words."""
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a decimal"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return "null"


def _wrong_type(param: str, expected: str, v) -> ApiError:
    return ApiError("invalid_type", f"Invalid type for '{param}': expected {expected}, but got {_what(v)} instead.",
                    param=param)


def _out_of_range(param: str, number: str, v, lo, hi) -> ApiError:
    below = v < lo if v == v else True  # NaN (json.loads reads it) is below any bound
    side, bound = ("below minimum", f">= {lo}") if below else ("above maximum", f"<= {hi}")
    return ApiError("invalid_value", f"Invalid '{param}': {number} {side} value. Expected a value {bound}, but got "
                                     f"{v} instead.", param=param)


def _integer(lo: int, hi: int | None = None) -> Callable[[str, object], None]:
    def check(name: str, v) -> None:
        if type(v) is not int:  # noqa: E721 - bool is an int subclass and is no count
            raise _wrong_type(name, "an integer", v)
        if v < lo or (hi is not None and v > hi):
            raise _out_of_range(name, "integer", v, lo, hi)
    return check


def _number(lo: float, hi: float) -> Callable[[str, object], None]:
    def check(name: str, v) -> None:
        if type(v) is not float and type(v) is not int:  # noqa: E721 - not a bool
            raise _wrong_type(name, "a decimal", v)
        if not lo <= v <= hi:
            raise _out_of_range(name, "decimal", v, lo, hi)
    return check


def _boolean(name: str, v) -> None:
    if v is not True and v is not False:
        raise _wrong_type(name, "a boolean", v)


def _stop(name: str, v) -> None:
    if isinstance(v, str):
        return
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _wrong_type(name, "a string or an array of strings", v)


def _stream_options(name: str, v) -> None:
    if not isinstance(v, dict):
        raise _wrong_type(name, "an object", v)
    usage = v.get("include_usage")
    if usage is not None and usage is not True and usage is not False:
        raise _wrong_type(f"{name}.include_usage", "a boolean", usage)


def _messages(name: str, v) -> None:
    if type(v) is not list:  # noqa: E721
        raise _wrong_type(name, "an array of objects", v)
    for m in v:  # the usual message passes three type tests; a bad one is worded by _bad_message
        if type(m) is dict and type(m.get("role")) is str:  # noqa: E721
            content = m.get("content")
            if content is None or type(content) is str or type(content) is list:  # noqa: E721
                continue
        _bad_message(name, v)


def _bad_message(name: str, v: list) -> None:
    """Raise the error of the first malformed message of `v`."""
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _wrong_type(f"{name}[{i}]", "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            if role is None:
                raise ApiError("missing_field", f"Missing required parameter: '{name}[{i}].role'.",
                               param=f"{name}[{i}].role")
            raise _wrong_type(f"{name}[{i}].role", "a string", role)
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _wrong_type(f"{name}[{i}].content", "a string or an array of content parts", content)


_TOKENS = _integer(1)
_SAMPLING: dict[str, Callable[[str, object], None]] = {
    "temperature": _number(0, 2), "top_p": _number(0, 1), "stream": _boolean,
}
_GENERATING = {**_SAMPLING, "max_tokens": _TOKENS, "n": _integer(1, MAX_N), "stop": _stop,
               "stream_options": _stream_options}
# operation -> field -> its check (an operation not here has only `model` checked)
CHECKS: dict[str, dict[str, Callable[[str, object], None]]] = {
    op.CHAT: {**_GENERATING, "messages": _messages, "max_completion_tokens": _TOKENS},
    op.COMPLETIONS: _GENERATING,
    op.RESPONSES: {**_SAMPLING, "max_output_tokens": _TOKENS},
}
_NONE: dict[str, Callable[[str, object], None]] = {}


def check(body: dict, operation: str) -> None:
    """Raise the ApiError (400, `param` set) of the first bad field of a JSON request `body` for
    `operation` (llmgw.surface), the model first; return None when every checked field is well formed."""
    model = body.get("model")
    if type(model) is not str or not model:  # noqa: E721
        if model is None or model == "":
            raise ApiError("missing_model", "'model' is required and must be a non-empty string", param="model")
        raise _wrong_type("model", "a string", model)
    checks = CHECKS.get(operation, _NONE)
    if not checks:
        return
    for name, v in body.items():
        if v is not None:
            c = checks.get(name)
            if c is not None:
                c(name, v)
    if body.get("stream_options") is not None and body.get("stream") is not True and "stream_options" in checks:
        raise ApiError("invalid_value", "Invalid value for 'stream_options': only allowed when 'stream' is true.",
                       param="stream_options")
