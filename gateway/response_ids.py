"""Responses API ids that lead back to the endpoint that created them. Pure.

An engine stores a response it created (and a conversation continued with `previous_response_id`)
itself, so `GET /v1/responses/{id}`, `DELETE` and `previous_response_id` must reach that endpoint.
The id a client sees carries it, so no gateway writes anything per request and every gateway (and
every worker) can read it:

    resp_ + 16 base64url characters (12 bytes: version 1, a 7-byte digest of the endpoint id, and a
    4-byte check over those and the engine's id) + the engine's own id

The digest is looked up among the endpoints the gateway routes to (an endpoint that left the list is
gone: 404); the check makes a mistyped or edited id a clean 404 instead of a request to an
arbitrary endpoint. It is validated, not signed: a client that forges one can only address an
endpoint it could reach anyway, with an engine id that engine must know.
"""

from __future__ import annotations

import base64
import hashlib
import json

PREFIX = "resp_"
VERSION = 1
_TAG = 16  # characters of base64url: 12 bytes
REF_BYTES = 7


def endpoint_ref(endpoint_id: str) -> bytes:
    return hashlib.blake2b(endpoint_id.encode(), digest_size=REF_BYTES, person=b"llmgw-endpoint").digest()


def _check(head: bytes, engine_id: str) -> bytes:
    return hashlib.blake2b(head + engine_id.encode(), digest_size=4, person=b"llmgw-response").digest()


def wrap(endpoint_id: str, engine_id: str) -> str:
    """The id a client sees for the engine's response `engine_id` on `endpoint_id`."""
    head = bytes([VERSION]) + endpoint_ref(endpoint_id)
    return PREFIX + base64.urlsafe_b64encode(head + _check(head, engine_id)).decode() + engine_id


def unwrap(client_id: str) -> tuple[bytes, str] | None:
    """(endpoint ref, engine id) of an id `wrap` made; None for anything else, tampered ones included."""
    if not client_id.startswith(PREFIX) or len(client_id) <= len(PREFIX) + _TAG:
        return None
    tag, engine_id = client_id[len(PREFIX):len(PREFIX) + _TAG], client_id[len(PREFIX) + _TAG:]
    try:
        raw = base64.urlsafe_b64decode(tag)
    except ValueError:
        return None
    if len(raw) != 1 + REF_BYTES + 4:
        return None
    head, check = raw[:1 + REF_BYTES], raw[1 + REF_BYTES:]
    if head[0] != VERSION or check != _check(head, engine_id):
        return None
    return head[1:], engine_id


class IdRewrite:
    """Turns the engine's response ids in an answer into the client's: the ids a request named (a
    retrieved response, `previous_response_id`) are known up front; a new response's id is learned
    from the answer (the `id` of a JSON body, or of the `response` in a stream's first event).
    Bytes are replaced where the quoted id appears, so everything else stays byte for byte."""

    __slots__ = ("endpoint_id", "pairs", "learning")

    def __init__(self, endpoint_id: str, known: dict[str, str] | None = None, learn: bool = False):
        self.endpoint_id = endpoint_id
        self.pairs = [(_quoted(e), _quoted(c)) for e, c in (known or {}).items()]
        self.learning = learn

    def _learn(self, engine_id: object) -> None:
        if isinstance(engine_id, str) and engine_id:
            self.pairs.append((_quoted(engine_id), _quoted(wrap(self.endpoint_id, engine_id))))
            self.learning = False

    def body(self, payload: bytes) -> bytes:
        """A whole JSON answer."""
        if self.learning:
            try:
                doc = json.loads(payload)
            except (ValueError, RecursionError):  # an engine's answer is input too: never a 500
                doc = None
            if isinstance(doc, dict):
                self._learn(doc.get("id"))
        return self._replace(payload)

    def chunk(self, data: bytes) -> bytes:
        """One piece of an SSE stream (the engine's events arrive whole: one HTTP chunk each)."""
        if self.learning and b'"response"' in data:
            for line in data.split(b"\n"):
                if line.startswith(b"data:"):
                    try:
                        event = json.loads(line[5:])
                    except (ValueError, RecursionError):
                        continue
                    response = event.get("response") if isinstance(event, dict) else None
                    if isinstance(response, dict):
                        self._learn(response.get("id"))
                        break
        return self._replace(data)

    def _replace(self, data: bytes) -> bytes:
        for engine, client in self.pairs:
            data = data.replace(engine, client)
        return data


def _quoted(s: str) -> bytes:
    return json.dumps(s).encode()
