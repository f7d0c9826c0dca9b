"""The path table, the engines' path maps, response ids (round trip and tampering), the multipart
form reader and the Responses API's usage. Pure."""

from __future__ import annotations

import json

import pytest
import requests

from gateway.request.forms import FormError, find_field
from gateway.upstream.stream import sse_usage, usage_from_json
from gateway.response_ids import IdRewrite, unwrap, wrap
from gateway.request.surface import flask_rules, match
from llmgw import surface as op
from llmgw.catalog import Profile
from llmgw.engines import ENGINES
from llmgw.state.records import EndpointInfo


@pytest.mark.parametrize("method,path,want", [
    ("POST", "/v1/chat/completions", (op.CHAT, None)),
    ("POST", "/v1/responses", (op.RESPONSES, None)),
    ("GET", "/v1/responses/resp_abc", (op.RESPONSES_GET, "resp_abc")),
    ("DELETE", "/v1/responses/resp_abc", (op.RESPONSES_DELETE, "resp_abc")),
    ("POST", "/v1/responses/resp_abc/cancel", (op.RESPONSES_CANCEL, "resp_abc")),
    ("POST", "/v1/audio/transcriptions", (op.TRANSCRIPTIONS, None)),
    ("POST", "/v1/tokenize", (op.TOKENIZE, None)),
    ("GET", "/v1/chat/completions", None),  # wrong method: Flask answers 405
    ("POST", "/v1/responses/resp_abc", None),
    ("GET", "/v1/responses/", None),
    ("GET", "/v1/responses/a/b", None),
    ("POST", "/tokenize", None),  # the engines' own paths are not the gateway's
])
def test_the_path_table(method, path, want):
    got = match(method, path)
    assert (None if got is None else (got[0].op, got[1])) == want


def test_every_operation_has_a_flask_rule_for_its_405s():
    rules = dict(flask_rules())
    assert sorted(rules["/v1/responses/<rid>"]) == ["DELETE", "GET"]
    assert rules["/v1/responses/<rid>/cancel"] == ["POST"]
    assert len(rules) == len({p for _, p in op.OPERATIONS.values()})


def test_what_each_engine_serves_and_where():
    vllm = ENGINES["vllm"].paths(Profile(name="g", engine="vllm", gpu={"class": "h100"}))
    assert vllm[op.TOKENIZE] == "/tokenize" and vllm[op.RERANK] == "/v1/rerank"
    assert op.RESPONSES_GET in vllm and op.RESPONSES_DELETE not in vllm  # vLLM deletes no stored response
    plain = ENGINES["llamacpp"].paths(Profile(name="c", engine="llamacpp"))
    assert plain == {op.CHAT: "/v1/chat/completions", op.COMPLETIONS: "/v1/completions",
                     op.RESPONSES: "/v1/responses", op.TOKENIZE: "/tokenize", op.DETOKENIZE: "/detokenize"}
    ranking = ENGINES["llamacpp"].paths(Profile(name="c", engine="llamacpp", args=["--embeddings", "--reranking"]))
    assert {op.EMBEDDINGS, op.RERANK} <= set(ranking)
    sim = ENGINES["sim"].paths(Profile(name="s", engine="sim"))
    assert op.EMBEDDINGS not in sim and sim[op.RESPONSES_DELETE] == "/v1/responses/{id}"
    generic = ENGINES["external"].paths(Profile(name="x", engine="external", url="http://h"))
    assert op.TOKENIZE not in generic and op.RESPONSES in generic
    as_vllm = ENGINES["external"].paths(Profile(name="x", engine="external", url="http://h", server="vllm"))
    assert as_vllm == vllm


def test_an_endpoint_published_without_a_map_serves_what_llmgw_proxied_before():
    old = EndpointInfo.from_dict({"id": "e", "url": "http://h", "models": ["m"], "engine": "vllm"})
    assert old.paths is None and old.serves(op.EMBEDDINGS) and not old.serves(op.RESPONSES)
    assert old.path(op.CHAT) == "/v1/chat/completions"
    new = EndpointInfo.from_dict({**old.to_dict(), "paths": {op.TOKENIZE: "/tokenize"}})
    assert new.serves(op.TOKENIZE) and not new.serves(op.CHAT) and new.path(op.TOKENIZE) == "/tokenize"
    assert hash(new)  # still usable as a frozen value


def test_response_ids_round_trip_and_refuse_tampering():
    cid = wrap("sim-a-1", "resp_0123abc")
    assert cid.startswith("resp_") and cid.endswith("resp_0123abc") and "sim-a-1" not in cid
    ref, engine_id = unwrap(cid)
    assert engine_id == "resp_0123abc" and ref != unwrap(wrap("sim-a-2", "resp_0123abc"))[0]
    assert unwrap(wrap("ext-m-p-abcdef", "x_y-z")) is not None  # any engine id, any endpoint id
    tampered = [
        cid[:-1] + ("d" if cid[-1] != "d" else "e"),  # the engine's id edited
        cid[:8] + ("A" if cid[8] != "A" else "B") + cid[9:],  # the endpoint digest edited
        cid[:5] + cid[6:],  # a character dropped
        "resp_0123abc",  # the engine's own id
        "resp_" + "!" * 16 + "x",
        "",
        "msg_" + cid[5:],
    ]
    for bad in tampered:
        assert unwrap(bad) is None, bad


def test_id_rewrite_learns_a_new_response_and_keeps_everything_else():
    rw = IdRewrite("e1", known={"resp_old": "resp_OLDCLIENT"}, learn=True)
    body = json.dumps({"id": "resp_new", "object": "response", "previous_response_id": "resp_old",
                       "output": [{"content": [{"text": 'he said "resp_new" twice'}]}]}).encode()
    out = json.loads(rw.body(body))
    assert out["id"] == wrap("e1", "resp_new") and out["previous_response_id"] == "resp_OLDCLIENT"
    assert out["output"][0]["content"][0]["text"] == 'he said "resp_new" twice'  # escaped quotes: not an id
    stream = IdRewrite("e2", learn=True)
    first = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_s"}}\n\n'
    assert wrap("e2", "resp_s").encode() in stream.chunk(first)
    later = b'data: {"type":"response.completed","response":{"id":"resp_s","usage":{}}}\n\n'
    assert stream.chunk(later).count(wrap("e2", "resp_s").encode()) == 1
    deep = b'{"id": "resp_d", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert IdRewrite("e3", learn=True).body(deep).endswith(b"]}")  # too deep to parse: passed on, not a 500
    deep_event = b'data: {"response": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n\n"
    assert IdRewrite("e3", learn=True).chunk(deep_event) == deep_event


def test_responses_usage_counts_like_chat_usage():
    assert usage_from_json(b'{"usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}}') == (7, 3)
    assert usage_from_json(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 2}}') == (5, 2)
    tail = (b'event: response.output_item.done\ndata: {"type":"response.output_item.done"}\n\n'
            b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"r",'
            b'"usage":{"input_tokens":31,"output_tokens":3,"total_tokens":34}},"timings":{"x":1}}\n\n')
    assert sse_usage(tail) == (31, 3)


def _form(fields: dict, files: dict | None = None) -> tuple[bytes, str]:
    req = requests.Request("POST", "http://x/", data=fields, files=files).prepare()
    return req.body, req.headers["Content-Type"]


def test_a_form_field_is_found_without_reading_the_file():
    body, ctype = _form({"language": "en", "model": "whisper"},
                        {"file": ("a.wav", b'RIFF--\r\nContent-Disposition: form-data; name="model"\r\n\r\nx', "audio/wav")})
    value, start, end = find_field(body, ctype, "model")
    assert value == "whisper" and body[start:end] == b"whisper"
    assert find_field(body, ctype, "prompt") is None
    body2, ctype2 = _form({}, {"file": ("a.wav", b"abc", "audio/wav")})
    assert find_field(body2, ctype2, "model") is None
    for bad_body, bad_type in [(body, "application/json"), (body, "multipart/form-data"),
                               (b"no parts here", ctype), (body2[:-10], ctype2)]:
        with pytest.raises(FormError):
            find_field(bad_body, bad_type, "model")
