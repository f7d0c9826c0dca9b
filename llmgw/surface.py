"""The OpenAI-compatible operations llmgw proxies, and what an engine's paths for them are.

An operation is a short name (`chat`, `responses.get`, `tokenize`, ...) for one method and path of
the surface the gateway serves. Each engine driver says which operations its engine serves and at
which of its own paths (`EngineDriver.paths(profile)`: llama-server tokenizes at `/tokenize`, not
`/v1/tokenize`); the publisher copies that map into every endpoint (`EndpointInfo.paths`), and the
gateway sends an operation only to endpoints that serve it. `{id}` in a path is a response id.
"""

from __future__ import annotations

CHAT = "chat"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
RESPONSES = "responses"
RESPONSES_GET = "responses.get"
RESPONSES_DELETE = "responses.delete"
RESPONSES_CANCEL = "responses.cancel"
RERANK = "rerank"
SCORE = "score"
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"
TRANSCRIPTIONS = "transcriptions"

# operation -> (method, the path clients call on the gateway); the OpenAI API's own where it has one.
OPERATIONS: dict[str, tuple[str, str]] = {
    CHAT: ("POST", "/v1/chat/completions"),
    COMPLETIONS: ("POST", "/v1/completions"),
    EMBEDDINGS: ("POST", "/v1/embeddings"),
    RESPONSES: ("POST", "/v1/responses"),
    RESPONSES_GET: ("GET", "/v1/responses/{id}"),
    RESPONSES_DELETE: ("DELETE", "/v1/responses/{id}"),
    RESPONSES_CANCEL: ("POST", "/v1/responses/{id}/cancel"),
    RERANK: ("POST", "/v1/rerank"),
    SCORE: ("POST", "/v1/score"),
    TOKENIZE: ("POST", "/v1/tokenize"),
    DETOKENIZE: ("POST", "/v1/detokenize"),
    TRANSCRIPTIONS: ("POST", "/v1/audio/transcriptions"),
}

# What an endpoint published without a path map (by an llmgw from before it had one) serves.
LEGACY_OPERATIONS = (CHAT, COMPLETIONS, EMBEDDINGS)


def same_paths(*ops: str) -> dict[str, str]:
    """`op -> path` for an engine that serves these operations at the gateway's own paths."""
    return {op: OPERATIONS[op][1] for op in ops}
