"""When a proxied request goes to another endpoint: a pure `next_attempt(outcome, attempt, retries)`.

Only failures before any byte reached the client are retried: a connect error (refused, reset, a
pooled connection the engine had closed) or a 5xx/429 answer. A first-byte timeout is not retried (the
engine may still be working on it; sending it elsewhere doubles the load). On the last attempt a 5xx or
429 answer is passed to the client as the engine sent it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """What one attempt produced: `connect_error`, `timeout`, or `answer` with its HTTP status."""

    kind: str
    status: int = 0


@dataclass(frozen=True)
class Deliver:
    """Pass the upstream's answer to the client."""


@dataclass(frozen=True)
class Retry:
    """Release the endpoint, exclude it, and route again."""

    reason: str  # for the upstream-errors metric: "connect" or the status code


@dataclass(frozen=True)
class GiveUp:
    """Answer the client with this error (an `ApiError` kind)."""

    kind: str  # "no_replica" | "upstream_timeout"


def retryable_status(status: int) -> bool:
    return status >= 500 or status == 429


def next_attempt(outcome: Outcome, attempt: int, retries: int) -> Deliver | Retry | GiveUp:
    """`attempt` counts from 0; at most `retries` further attempts follow the first."""
    more = attempt < retries
    if outcome.kind == "connect_error":
        return Retry("connect") if more else GiveUp("no_replica")
    if outcome.kind == "timeout":
        return GiveUp("upstream_timeout")
    if outcome.kind == "answer":
        return Retry(str(outcome.status)) if more and retryable_status(outcome.status) else Deliver()
    raise ValueError(f"unknown outcome kind {outcome.kind!r}")
