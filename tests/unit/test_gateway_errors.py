"""An engine's error answer in the gateway's one shape (gateway.errors.engine_error): each dialect an
engine speaks (llama-server's, vLLM's new and old, FastAPI's, plain text, none) becomes
`{"error": {"message", "type", "code"}}` with string type and code and the engine's own message."""

import json

import pytest

from gateway.errors import TABLE, engine_error

LLAMA_400 = b'{"error":{"code":400,"message":"Expected \'messages\' to be an array","type":"invalid_request_error"}}'
# llama-server's answers as this llama-server build gave them (b11434, SmolLM2 at -c 256).
LLAMA_CONTEXT = (b'{"error":{"code":400,"message":"request (631 tokens) exceeds the available context size '
                 b'(256 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":631,'
                 b'"n_ctx":256}}')
LLAMA_501 = (b'{"error":{"code":501,"message":"This server does not support embeddings. Start it with `--embeddings`",'
             b'"type":"not_supported_error"}}')
VLLM_400 = (b'{"error":{"message":"This model\'s maximum context length is 2048 tokens. However, you requested 4000 '
            b'tokens.","type":"BadRequestError","param":null,"code":400}}')
VLLM_OLD_404 = (b'{"object":"error","message":"The model `x` does not exist.","type":"NotFoundError",'
                b'"param":null,"code":404}')
FASTAPI_422 = b'{"detail":[{"loc":["body","messages"],"msg":"field required","type":"value_error.missing"}]}'


@pytest.mark.parametrize("status, body, want", [
    (400, LLAMA_400, (400, "invalid_request_error", "invalid_request", "Expected 'messages' to be an array")),
    (400, LLAMA_CONTEXT, (400, "invalid_request_error", "context_length_exceeded",
                          "request (631 tokens) exceeds the available context size (256 tokens), try increasing it")),
    (501, LLAMA_501, (501, "server_error", "upstream_error",
                      "This server does not support embeddings. Start it with `--embeddings`")),
    (400, VLLM_400, (400, "invalid_request_error", "context_length_exceeded",
                     "This model's maximum context length is 2048 tokens. However, you requested 4000 tokens.")),
    (404, VLLM_OLD_404, (404, "invalid_request_error", "not_found", "The model `x` does not exist.")),
    (422, FASTAPI_422, (422, "invalid_request_error", "invalid_request", "body.messages: field required")),
    (429, b'{"error": "too many requests"}', (429, "rate_limit_error", "overloaded", "too many requests")),
    (413, b"<html>413 Request Entity Too Large</html>",
     (413, "invalid_request_error", "request_too_large", "<html>413 Request Entity Too Large</html>")),
    (500, b"Internal Server Error", (500, "server_error", "upstream_error", "Internal Server Error")),
    (503, b"", (503, "server_error", "upstream_error", "the engine answered HTTP 503 with no message")),
    (400, b'["odd"]', (400, "invalid_request_error", "invalid_request", '["odd"]')),
    # Only the gateway's credential reaches an engine: its refusal is the gateway's failure, not the client's.
    (401, b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}',
     (502, "server_error", "upstream_error",
      "endpoint e1 refused the gateway's credential (HTTP 401): Invalid API Key")),
])
def test_every_dialect_becomes_the_one_shape(status, body, want):
    got_status, payload = engine_error(status, body, "e1")
    doc = json.loads(payload)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "code"}
    err = doc["error"]
    assert (got_status, err["type"], err["code"], err["message"]) == want
    assert (err["type"], err["code"]) in {(t, c) for _, t, c in TABLE.values()}  # the gateway's own vocabulary


def test_a_long_text_body_is_cut():
    _, payload = engine_error(502, b"x" * 10_000, "e1")
    assert len(json.loads(payload)["error"]["message"]) == 2000
