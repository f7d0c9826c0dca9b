"""The one thing the gateway reads from a multipart/form-data body: a field's value. Pure.

`POST /v1/audio/transcriptions` names its model in a form field beside the audio file. The gateway
finds that field by scanning the parts' headers (never decoding the file), and hands the body on
as it came, except for that value when the endpoint serves the model under another name.
"""

from __future__ import annotations

import re

_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


class FormError(ValueError):
    """The body is not multipart/form-data as its Content-Type says."""


def boundary(content_type: str) -> bytes:
    if not content_type.lower().startswith("multipart/form-data"):
        raise FormError(f"expected a multipart/form-data body, got Content-Type {content_type[:80]!r}")
    m = _BOUNDARY.search(content_type)
    if not m:
        raise FormError("the multipart/form-data Content-Type names no boundary")
    return (m.group(1) or m.group(2)).encode("latin-1")


def find_field(body: bytes, content_type: str, name: str) -> tuple[str, int, int] | None:
    """(value, start, end) of the first form field called `name` (its bytes are body[start:end]);
    None when the form has no such field. Raises FormError for a body that is not a form."""
    delim = b"--" + boundary(content_type)
    want = name.encode()
    at = body.find(delim)
    if at < 0:
        raise FormError("the body holds no part of the multipart form")
    while True:
        start = at + len(delim)
        if body[start:start + 2] == b"--":
            return None  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", start)
        if head_end < 0:
            raise FormError("a part of the multipart form has no end of headers")
        nxt = body.find(b"\r\n" + delim, head_end + 4)
        if nxt < 0:
            raise FormError("the multipart form is not closed")
        for line in body[start:head_end].split(b"\r\n"):
            if line.lower().startswith(b"content-disposition:"):
                m = _NAME.search(line)
                if m and m.group(1) == want:
                    value = body[head_end + 4:nxt]
                    try:
                        return value.decode(), head_end + 4, nxt
                    except UnicodeDecodeError:
                        raise FormError(f"the form field {name!r} is not text") from None
        at = nxt + 2
