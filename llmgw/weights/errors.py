"""What the weights package raises on purpose: a bad `source:` and a download that cannot finish."""

from __future__ import annotations

from llmgw.errors import LlmgwError


class SourceInvalid(LlmgwError):
    """A `source:` that cannot be parsed, or that an engine cannot load."""

    def __init__(self, source: str, reason: str):
        self.source, self.reason = source, reason
        super().__init__(f"source {source!r}: {reason}")


class DownloadFailed(LlmgwError):
    """A download that stopped; `kind` is one word a shell can act on, `reason` the sentence a user reads.

    Kinds: auth (401/403), not_found (404), disk_full, checksum, connection, offline, ambiguous (a
    pattern that names several files), server (any other HTTP status), cancelled."""

    def __init__(self, source: str, kind: str, reason: str, retryable: bool = False):
        self.source, self.kind, self.reason, self.retryable = source, kind, reason, retryable
        super().__init__(f"{source}: {reason}")
