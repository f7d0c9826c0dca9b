"""A batch input file, line by line: what makes a line a valid request, and how the file is cut into
the chunks Redis keeps. Pure: the upload view feeds it lines as they arrive (never the whole file),
the feeder reads the chunks back with `requests_in`.

A valid line is one JSON object: `custom_id` (a string, unique in the file), `method` "POST", `url`
one of the batch endpoints (the same on every line), and `body` an object whose `model` is a string
(the same on every line: a batch runs one model) and which does not ask for a stream. Blank lines
are skipped; lines are numbered from 1 as an editor shows them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from llmgw.state.batch_records import ENDPOINTS

MAX_CUSTOM_ID = 512
MAX_PROBLEMS = 20  # problems kept (and said) per file; the count says how many more
CHUNK_BYTES = 256 * 1024  # target size of one stored chunk (whole lines; a longer line is a chunk alone)


@dataclass(frozen=True)
class Problem:
    """One reason a file cannot run, in OpenAI's BatchError terms."""

    line: int | None
    code: str
    message: str
    param: str | None = None

    def text(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message

    def to_error(self) -> dict:
        return {"code": self.code, "message": self.message, "line": self.line, "param": self.param}


@dataclass(frozen=True)
class Limits:
    max_file_bytes: int
    max_requests: int
    max_line_bytes: int


@dataclass(frozen=True)
class Request:
    """One line read back for sending."""

    index: int  # 0-based among the file's requests: the key of its result
    custom_id: str
    body: dict


@dataclass
class FileChecker:
    """Checks an input file fed one physical line at a time (`line`), keeping only what it needs to
    (the custom ids seen, the first url and model, the first MAX_PROBLEMS problems)."""

    limits: Limits
    lineno: int = 0
    bytes: int = 0
    requests: int = 0
    endpoint: str = ""
    model: str = ""
    problems: list[Problem] = field(default_factory=list)
    more_problems: int = 0
    _ids: dict[str, int] = field(default_factory=dict)
    _first: dict[str, int] = field(default_factory=dict)  # "url"/"model" -> the line that set it

    @property
    def first_line(self) -> int:
        """The line of the first request."""
        return self._first.get("model", 0)

    @property
    def too_large(self) -> bool:
        return self.bytes > self.limits.max_file_bytes

    def _problem(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(line, code, message, param))
        else:
            self.more_problems += 1

    def line(self, raw: bytes) -> str | None:
        """Check one physical line (with or without its newline); returns its text as sent (newline
        included) when it is a request or blank, None when it is wrong (the problem is kept)."""
        self.lineno += 1
        self.bytes += len(raw)
        n = self.lineno
        if self.too_large:
            return None
        content = raw.rstrip(b"\r\n")
        if len(content) > self.limits.max_line_bytes:
            self._problem(n, "line_too_large", f"{len(content)} bytes; a line may have at most "
                                               f"{self.limits.max_line_bytes} (LLMGW_BATCH_MAX_LINE_BYTES)")
            return None
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError as e:
            self._problem(n, "invalid_json_line", f"not UTF-8 text (byte {e.start + 1})")
            return None
        if not text.strip():
            return raw.decode("utf-8")
        self.requests += 1
        if self.requests > self.limits.max_requests:
            if self.requests == self.limits.max_requests + 1:
                self._problem(n, "too_many_requests", f"a batch file may hold at most {self.limits.max_requests} "
                                                      "requests (LLMGW_BATCH_MAX_REQUESTS)")
            return None
        return raw.decode("utf-8") if self._check(n, text) else None

    def _check(self, n: int, text: str) -> bool:
        try:
            doc = json.loads(text)
        except ValueError as e:
            self._problem(n, "invalid_json_line", f"not valid JSON: {e.msg} (column {e.colno})")
            return False
        if not isinstance(doc, dict):
            self._problem(n, "invalid_json_line", f"expected a JSON object, got {type(doc).__name__}")
            return False
        ok = True
        cid = doc.get("custom_id")
        if not isinstance(cid, str) or not cid:
            self._problem(n, "missing_custom_id", "custom_id: expected a non-empty string", "custom_id")
            ok = False
        elif len(cid) > MAX_CUSTOM_ID:
            self._problem(n, "invalid_custom_id", f"custom_id: at most {MAX_CUSTOM_ID} characters", "custom_id")
            ok = False
        elif cid in self._ids:
            self._problem(n, "duplicate_custom_id", f"custom_id {cid!r} repeats line {self._ids[cid]}", "custom_id")
            ok = False
        else:
            self._ids[cid] = n
        if doc.get("method") != "POST":
            self._problem(n, "invalid_method", f"method: expected \"POST\", got {doc.get('method')!r}", "method")
            ok = False
        url = doc.get("url")
        if url not in ENDPOINTS:
            self._problem(n, "invalid_url", f"url: expected one of {', '.join(ENDPOINTS)}, got {url!r}", "url")
            ok = False
        else:
            ok = self._same(n, "url", url, "endpoint", "a batch sends every line to one endpoint") and ok
        body = doc.get("body")
        if not isinstance(body, dict):
            self._problem(n, "missing_body", "body: expected a JSON object (the request)", "body")
            return False
        model = body.get("model")
        if not isinstance(model, str) or not model:
            self._problem(n, "missing_model", "body.model: expected a model name", "body.model")
            ok = False
        else:
            ok = self._same(n, "model", model, "model", "a batch runs one model") and ok
        if body.get("stream") is True:
            self._problem(n, "invalid_body", "body.stream: a batch line is answered whole; remove \"stream\"",
                          "body.stream")
            ok = False
        return ok

    def _same(self, n: int, what: str, value: str, attr: str, why: str) -> bool:
        first = getattr(self, attr)
        if not first:
            setattr(self, attr, value)
            self._first[what] = n
            return True
        if value != first:
            code = "mismatched_model" if what == "model" else "mismatched_url"
            self._problem(n, code, f"{'body.model' if what == 'model' else 'url'} {value!r} differs from line "
                                   f"{self._first[what]}'s {first!r}: {why}", "body.model" if what == "model" else "url")
            return False
        return True

    def finish(self) -> list[Problem]:
        """Every problem of the file (the last one says how many more there were); empty when it can run."""
        out = list(self.problems)
        if self.too_large:
            out.insert(0, Problem(None, "file_too_large", f"the file has more than {self.limits.max_file_bytes} bytes "
                                                          "(LLMGW_BATCH_MAX_FILE_BYTES)"))
        elif self.requests == 0 and not out:
            out.append(Problem(None, "empty_file", "the file holds no request (one JSON object per line)"))
        if self.more_problems:
            out.append(Problem(None, "more_problems", f"and {self.more_problems} more problems"))
        return out


def summary(problems: list[Problem], limit: int = 5) -> str:
    """The problems in one message: the first few, then how many more."""
    shown = "; ".join(p.text() for p in problems[:limit])
    rest = len(problems) - limit
    return shown + (f"; and {rest} more" if rest > 0 else "")


@dataclass
class Chunker:
    """Packs the file's lines, as sent, into chunks of about CHUNK_BYTES (whole lines; a longer line is
    a chunk of its own)."""

    target: int = CHUNK_BYTES
    parts: list[str] = field(default_factory=list)
    size: int = 0
    chunks: int = 0  # chunks handed out so far

    def add(self, text: str, size: int) -> str | None:
        """Add a line (`size`: its bytes); returns the chunk before it when it did not fit there."""
        out = None
        if self.parts and self.size + size > self.target:
            out = self.flush()
        self.parts.append(text)
        self.size += size
        return out

    def flush(self) -> str | None:
        if not self.parts:
            return None
        chunk, self.parts, self.size = "".join(self.parts), [], 0
        self.chunks += 1
        return chunk


def requests_in(chunks: Iterable[str]) -> Iterator[Request]:
    """The requests of an input file's stored chunks, in order. Only lines that passed the checker
    were stored (blank ones never), so every line parses."""
    index = 0
    for chunk in chunks:
        for text in chunk.split("\n"):  # not splitlines: U+2028 may stand in a JSON string
            if not text.strip():
                continue
            doc = json.loads(text)
            yield Request(index, doc["custom_id"], doc["body"])
            index += 1
