"""The Batch API's records: stored files and batches, as facts; the status users see is derived. Pure.

A batch stores what happened and when (`in_progress_at`, `cancelling_at`, `sealed_at`, ...) and
counters that only grow (lines answered, lines failed, tokens, the output files' bytes); `status`
turns them into OpenAI's statuses in one place, with a table-driven test (tests/unit/test_batch_core.py).
The store's `batches` aggregate reads and writes them (`llmgw.state.store.batches`); docs/batch.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

# OpenAI's batch statuses, and the ones after which nothing changes.
STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
ENDED = frozenset({"failed", "completed", "expired", "cancelled"})
# The endpoints a batch may name (OpenAI's, those llmgw proxies).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
ANONYMOUS_OWNER = "anonymous"  # files and batches made while the gateway required no key


@dataclass(frozen=True)
class FileRecord:
    """A stored file. `purpose` "batch": an upload, its content in Redis in chunks of whole lines;
    "batch_output": a batch's output (`kind` "output") or error ("error") file, whose lines are that
    batch's results (`batch_id`), read in line order when its content is asked for."""

    id: str
    owner: str  # the API key id that uploaded it (or whose batch made it), else ANONYMOUS_OWNER
    filename: str
    purpose: str
    bytes: int
    created_at: float
    # Uploads: how many requests (non-blank lines) in how many stored chunks, and what every line names
    # (they all name the same endpoint url and model).
    requests: int = 0
    chunks: int = 0
    endpoint: str = ""
    model: str = ""
    first_line: int = 0  # the line of the first request (where a refusal about the model points)
    batch_id: str = ""
    kind: str = "input"  # input | output | error

    def to_fields(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, d: dict[str, Any]) -> "FileRecord":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class BatchRecord:
    """One batch: what it was asked to do, what happened and when (epoch seconds), and its counters."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str  # as asked ("24h")
    created_at: float
    expires_at: float  # created_at + the window: lines not answered by then are expired
    total: int  # requests in the input file
    model: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    in_progress_at: float | None = None  # a batch worker took it
    finalizing_at: float | None = None  # every line answered (or the window ended): files being made
    completed_at: float | None = None
    failed_at: float | None = None  # refused before anything ran (`errors` says why)
    expired_at: float | None = None
    cancelling_at: float | None = None  # asked to cancel: nothing more is sent
    cancelled_at: float | None = None
    sealed_at: float | None = None  # no line is written after this; then the files and the final status
    sealed_as: str = ""  # what it ends as once its files are made: completed | cancelled | expired
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] = field(default_factory=list)  # OpenAI's BatchError dicts (code, message, line, param)
    # Progress samples (ts, lines done), the last few, written by the feeder: the console's rate.
    progress: list[list[float]] = field(default_factory=list)
    # The counters (HINCRBY by the line script, never written whole).
    n_completed: int = 0
    n_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    out_bytes: int = 0
    err_bytes: int = 0

    COUNTERS = ("n_completed", "n_failed", "prompt_tokens", "completion_tokens", "out_bytes", "err_bytes")

    def to_fields(self) -> dict[str, Any]:
        """The stored fields: the facts that are set (an absent field is a fact not yet true: the
        scripts test `sealed_at` by its presence), never the counters."""
        return {k: v for k, v in asdict(self).items() if v is not None and k not in self.COUNTERS}

    @classmethod
    def from_fields(cls, d: dict[str, Any]) -> "BatchRecord":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def done(self) -> int:
        """Lines answered either way."""
        return self.n_completed + self.n_failed

    @property
    def status(self) -> str:
        return status(self)

    @property
    def ended(self) -> bool:
        return self.status in ENDED


def status(b: BatchRecord) -> str:
    """OpenAI's status of a batch, from its facts. The final facts win over the ones before them: a
    batch cancelled while finalizing is cancelled; `failed` is only set before anything ran."""
    if b.failed_at is not None:
        return "failed"
    if b.cancelled_at is not None:
        return "cancelled"
    if b.expired_at is not None:
        return "expired"
    if b.completed_at is not None:
        return "completed"
    if b.cancelling_at is not None:
        return "cancelling"
    if b.finalizing_at is not None:
        return "finalizing"
    if b.in_progress_at is not None:
        return "in_progress"
    return "validating"
