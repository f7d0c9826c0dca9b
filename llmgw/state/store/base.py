"""What every aggregate of the store shares: the client, the pipeline type, and small decoders."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Mapping, TypeVar

import redis

Pipeline = redis.client.Pipeline
T = TypeVar("T")


class Aggregate:
    """One aggregate's reads and writes over `self.r`; `Store` is every aggregate over one client.
    An aggregate may call another's methods through `self` (they all end up on the one facade)."""

    r: redis.Redis


def ms(seconds: float) -> int:
    """A TTL in whole milliseconds (PX), never zero: a zero TTL is an error in Redis."""
    return max(1, int(seconds * 1000))


def floats(h: Mapping[str, str]) -> dict[str, float]:
    """A hash of name -> number; unreadable entries are skipped."""
    out = {}
    for name, raw in h.items():
        try:
            out[name] = float(raw)
        except ValueError:
            pass
    return out


def decoded(raws: Iterable[str | None], parse: Callable[[Any], T]) -> list[T]:
    """`parse(json.loads(raw))` of each present value; a value from a newer or broken writer is skipped
    (read afresh next time, never fatal to the reader)."""
    out = []
    for raw in raws:
        if raw:
            try:
                out.append(parse(json.loads(raw)))
            except (ValueError, TypeError):
                continue
    return out


def compact(doc: Any, **kw) -> str:
    """JSON without spaces (values written often or read by many)."""
    return json.dumps(doc, separators=(",", ":"), **kw)
