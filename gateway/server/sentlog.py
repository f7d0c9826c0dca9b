"""What each gunicorn worker of one gateway sent where, shared with its siblings, so every worker's
prefix index (gateway.routing.prefixindex) holds what the whole gateway sent each endpoint.

Without it each worker knows only its own requests: the next turn of a conversation, taken by the
other worker, finds no endpoint holding its history there and is placed by its system prompt alone:
with 2 workers far more later turns moved engine, and fewer prompt tokens stayed cached, than with one
(`python -m bench.prefix` counts both; docs/history.md has the runs before and after this log).

A ring of int64 words in the same shared anonymous memory as the in-flight table
(gateway.server.siblings: made by the gunicorn master before it forks). Each routing decision that
has prompt keys appends one entry (the writer's row and key count, the endpoint's 63-bit key, when
it was sent and the prefill seconds it still needed there, both in microseconds on the host's
monotonic clock, which forked workers share; then the block keys) and first reads the entries the siblings appended since its last look. Both happen under
the table's decision lock; a decision that did not get the lock in time neither reads nor writes (the
entry it would have written is lost to the siblings, never torn). A worker that falls more than the
ring behind starts again from its end: what it missed is lost, as an evicted block is.
"""

from __future__ import annotations

import mmap
from array import array
from typing import Mapping, NamedTuple, Sequence

from gateway.routing.prefixkeys import MAX_BLOCKS

WORDS = 1 << 20  # ring size in int64 words (8 MiB): ~2,000 long prompts of MAX_BLOCKS keys
_HEAD = 1  # words before the ring: how many words were ever written
_ENTRY = 4  # words before an entry's keys: row and key count, endpoint key, sent at, prefill (us)


class Sent(NamedTuple):
    """One request a sibling sent: where, its prompt's block keys, when (monotonic seconds) and the
    prefill seconds it still needed there (gateway.routing.backlog)."""

    endpoint: str
    keys: list[int]
    at: float
    prefill: float


class SentLog:
    """A view of the ring from one worker (`row`; -1: the master's, which only makes it)."""

    def __init__(self, buf, key_of, row: int = -1, words: int = WORDS):
        self.raw, self.key_of = buf, key_of  # key_of: an endpoint id's 63-bit key (as the table's)
        self.buf = memoryview(buf).cast("q")
        self.size = words
        self.row = row
        self.cursor = self.buf[0]  # what this view has read up to (words ever written)
        self._ids: dict[int, str] = {}  # endpoint key -> id, of the endpoints last asked about
        self._ids_of: object = None  # the mapping `_ids` was built from

    @classmethod
    def create(cls, key_of, words: int = WORDS) -> "SentLog":
        return cls(mmap.mmap(-1, (_HEAD + words) * 8), key_of, -1, words)

    def for_row(self, row: int) -> "SentLog":
        return SentLog(self.raw, self.key_of, row, self.size)

    def append(self, endpoint_id: str, keys: Sequence[int], at: float = 0.0, prefill: float = 0.0) -> None:
        """Our request with prompt `keys` went to the endpoint at `at` (monotonic seconds), needing
        `prefill` seconds of prompt there (call under the decision lock)."""
        assert self.row >= 0, "the master's view writes nothing"
        n = min(len(keys), MAX_BLOCKS)
        words = array("q", [(self.row + 1) << 32 | n, self.key_of(endpoint_id), int(at * 1e6), int(prefill * 1e6)])
        words.extend(keys[:n])
        pos, size = self.buf[0], self.size
        start = pos % size
        first = min(len(words), size - start)
        self.buf[_HEAD + start:_HEAD + start + first] = memoryview(words)[:first]
        if first < len(words):
            self.buf[_HEAD:_HEAD + len(words) - first] = memoryview(words)[first:]
        self.buf[0] = pos + len(words)

    def _words(self, at: int, n: int) -> list[int]:
        start = at % self.size
        first = min(n, self.size - start)
        out = self.buf[_HEAD + start:_HEAD + start + first].tolist()
        if first < n:
            out += self.buf[_HEAD:_HEAD + n - first].tolist()
        return out

    def siblings_sent(self, endpoints: Mapping[str, object]) -> list[Sent]:
        """What the siblings sent since our last look, to the endpoints in `endpoints` (by id; others
        are dropped), in the order sent. Call under the decision lock."""
        pos = self.buf[0]
        if pos - self.cursor > self.size:  # overrun: what we missed is gone
            self.cursor = pos
            return []
        if endpoints is not self._ids_of:
            self._ids, self._ids_of = {self.key_of(i): i for i in endpoints}, endpoints
        out = []
        at = self.cursor
        while at < pos:
            tag, ep, sent_us, prefill_us = self._words(at, _ENTRY)
            n = tag & 0xFFFFFFFF
            if (tag >> 32) - 1 != self.row and (eid := self._ids.get(ep)) is not None:
                out.append(Sent(eid, self._words(at + _ENTRY, n), sent_us / 1e6, prefill_us / 1e6))
            at += _ENTRY + n
        self.cursor = pos
        return out
