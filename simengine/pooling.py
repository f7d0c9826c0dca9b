"""The simulated engine's answers that generate nothing: rerank, score, transcription. Pure, in
vLLM's shapes; token counts are simengine.tokens'. Relevance is the share of the query's words a
document holds: deterministic, and higher for the document that repeats the query.
"""

from __future__ import annotations

import email.parser
import email.policy
import re
import uuid
from typing import Any

from simengine.tokens import tokenize

TRANSCRIPT = "the simulated engine heard this audio"
_WORD = re.compile(r"\w+")


def relevance(query: str, document: str) -> float:
    q = {w.lower() for w in _WORD.findall(query)}
    d = {w.lower() for w in _WORD.findall(document)}
    return round(len(q & d) / len(q), 6) if q else 0.0


def document_text(doc: Any) -> str:
    return doc.get("text", "") if isinstance(doc, dict) else str(doc)


def rerank(model: str, query: str, documents: list, top_n: int | None) -> tuple[dict, int]:
    """The answer, and the prompt tokens it took."""
    scored = sorted(((relevance(query, document_text(d)), i, d) for i, d in enumerate(documents)),
                    key=lambda x: (-x[0], x[1]))
    if top_n:
        scored = scored[:top_n]
    tokens = sum(len(tokenize(query)) + len(tokenize(document_text(d))) for d in documents)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
            "results": [{"index": i, "document": {"text": document_text(d)}, "relevance_score": s}
                        for s, i, d in scored]}, tokens


def score(model: str, text_1: Any, text_2: Any, created: int) -> tuple[dict, int]:
    """vLLM's /v1/score: one text against each of a list (or pairwise for two lists)."""
    firsts = text_1 if isinstance(text_1, list) else [text_1]
    seconds = text_2 if isinstance(text_2, list) else [text_2]
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    pairs = list(zip(firsts, seconds))
    tokens = sum(len(tokenize(str(a))) + len(tokenize(str(b))) for a, b in pairs)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": relevance(str(a), str(b))}
                     for i, (a, b) in enumerate(pairs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, tokens


def form_fields(content_type: str, body: bytes) -> dict[str, str | bytes]:
    """The fields of a multipart/form-data body (text fields as str, files as bytes); raises
    ValueError when it is not one."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ValueError(f"expected multipart/form-data, got {content_type!r}")
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not msg.is_multipart():
        raise ValueError("the multipart body could not be read")
    out: dict[str, str | bytes] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            data = part.get_payload(decode=True) or b""
            out[str(name)] = data if part.get_filename() else data.decode(errors="replace")
    return out
