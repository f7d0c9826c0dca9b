"""In-flight counts shared by the gunicorn workers of one gateway, so they route as one router.

Each worker counts its own requests per endpoint exactly; without this it would see its siblings'
requests only in the engines' scrapes, a second late. Two workers then each hold requests for a
fast endpoint the other has just filled, or both send to it past its capacity (two workers' time
to first token tail was far longer than one worker's: `python -m bench.routing --gateway-workers 2`,
docs/benchmarks.md).

The table is an anonymous shared memory map the gunicorn master makes before it forks (so every
worker inherits the same pages): one row per worker, each written by its worker alone, so no lock
is needed; a reader sums the other rows. A row holds, per endpoint (keyed by a 63-bit hash of its
id, in one of the PROBE entries from its hash's place), the count now and the highest count since
`peak_at`: a scrape taken a moment ago is compared with what the siblings held then, not after
their requests ended (gateway.routing.inflight). Beside it, in shared memory too, the log of what
each worker sent where (gateway.server.sentlog), so the workers' prefix indexes agree.
Aligned 8-byte stores on x86-64 and arm64 are not torn. A routing decision (read the siblings' counts,
choose, add our own) holds the table's one cross-process lock (`deciding`), so two workers never both
take an endpoint's last free slot; the lock is held for microseconds and waited for at most
DECIDE_WAIT, so a worker killed inside it (its lock is never released) costs its siblings that bounded
wait per decision, and they then decide alone, as without a table.

The master makes the table and assigns rows (gateway/gunicorn_conf.py: `claim_row` in pre_fork,
`free_row` when a worker exits, which also drops its counts: its streams died with it); the worker's
view of its row is handed to the app factory while the worker makes its app (`handing`, from
gateway.server.worker: gunicorn calls `gateway:create_app()` with no arguments), so the gateway is
built counting with its siblings. Without gunicorn, or with one worker, there is no table and the
gateway counts alone.
"""

from __future__ import annotations

import contextvars
import hashlib
import mmap
import multiprocessing
import os
import socket
from contextlib import contextmanager
from typing import Iterator

from gateway.server.board import Board
from gateway.server.sentlog import SentLog

ENDPOINTS = 256  # endpoints one row can count (a gateway's whole fleet); past that, counted alone
PROBE = 16  # entries from an endpoint's place where it may sit: bounds every lookup, whatever the churn
PEAK_WINDOW = 3.0  # seconds a peak is remembered: a scrape is at most ~2 load intervals old when read
DECIDE_WAIT = 0.005  # seconds a decision waits for the siblings' lock before it goes on alone

# int64s before a row's entries: owner pid (0 free, -1 claimed), requests it released, client
# connections it holds open (gateway.server.worker: how many it accepts per turn)
_HEAD = 3
_ENTRY = 4  # int64s per entry: key (0 empty), count, peak, peak_at (microseconds, monotonic)
_ROW = _HEAD + ENDPOINTS * _ENTRY


def key_of(endpoint_id: str) -> int:
    """A nonzero 63-bit key for an endpoint id (collisions: 1 in 2^63 per pair)."""
    return (int.from_bytes(hashlib.blake2b(endpoint_id.encode(), digest_size=8).digest(), "big") >> 1) or 1


class SharedCounts:
    """A view of the table from one worker (`row`), or from the master (`row` None: assigns rows)."""

    def __init__(self, buf, rows: int, row: int | None = None, lock=None, sent: SentLog | None = None,
                 origin: str = "", board: Board | None = None):
        self.raw = buf  # the shared bytes (an mmap); `buf` reads them as int64s
        # The gateway these workers make up (the master's host:pid): what they send is shared with the
        # other gateways under this name, and read back by none of them (gateway.server.sendshare).
        self.origin = origin or f"{socket.gethostname()}:{os.getpid()}"
        self.lock = lock if lock is not None else multiprocessing.get_context("fork").Lock()
        self.buf = memoryview(buf).cast("q")
        self.rows = rows
        self.row = row
        self._slots: dict[str, int] = {}  # endpoint id -> entry index in our row (where we write)
        self._keys: dict[str, int] = {}  # endpoint id -> key_of(id): read on every routing decision
        # What each worker sent where, for the siblings' prefix indexes (gateway.server.sentlog).
        self.sent = sent if sent is not None else SentLog.create(key_of)
        # The workers' queue heads and running answers: one order, and evictions across workers
        # (gateway.server.board).
        self.board = board if board is not None else Board.create(rows)

    @classmethod
    def create(cls, rows: int) -> "SharedCounts":
        """A new table in shared anonymous memory (MAP_SHARED: forked children see the same pages)."""
        return cls(mmap.mmap(-1, rows * _ROW * 8), rows)

    def for_row(self, row: int) -> "SharedCounts":
        return SharedCounts(self.raw, self.rows, row, self.lock, self.sent.for_row(row), self.origin,
                            self.board.for_row(row))

    def deciding(self) -> "_Deciding":
        """Held around one routing decision (read, choose, reserve), across the worker processes."""
        return _Deciding(self.lock)

    # --- the master ---------------------------------------------------------------------------------
    def claim_row(self) -> int | None:
        """A free row for the worker about to fork, marked taken; None when every row is taken."""
        for r in range(self.rows):
            if self.buf[r * _ROW] == 0:
                self._clear(r)
                self.buf[r * _ROW] = -1
                return r
        return None

    def free_row(self, row: int) -> None:
        """Its worker exited: its requests are gone, and the row is free for the next one."""
        self._clear(row)
        self.board.clear(row)
        self.buf[row * _ROW] = 0

    def _clear(self, row: int) -> None:
        base = row * _ROW
        self.buf[base + 1:base + _ROW] = memoryview(bytes((_ROW - 1) * 8)).cast("q")

    # --- a worker -----------------------------------------------------------------------------------
    def _key(self, endpoint_id: str) -> int:
        k = self._keys.get(endpoint_id)
        if k is None:
            if len(self._keys) > 4 * ENDPOINTS:  # endpoints come and go: keep the cache bounded
                self._keys.clear()
            k = self._keys[endpoint_id] = key_of(endpoint_id)
        return k

    def adopt(self, pid: int) -> None:
        self.buf[self.row * _ROW] = pid
        self.board.adopt(pid)

    def _find(self, row: int, key: int) -> int | None:
        """Entry index of `key` in `row`, or None: it sits within PROBE entries of its place."""
        base = row * _ROW + _HEAD
        for d in range(PROBE):
            i = (key + d) % ENDPOINTS
            if self.buf[base + i * _ENTRY] == key:
                return i
        return None

    def _slot(self, endpoint_id: str, now: float) -> int | None:
        """Where our row counts `endpoint_id`: its entry, else a new one within PROBE of its place (an
        empty entry, or one of an endpoint we hold nothing on and have not for PEAK_WINDOW: endpoints
        come and go with replicas); None when all PROBE are taken (it is then counted alone)."""
        i = self._slots.get(endpoint_id)
        if i is not None:
            return i
        key = self._key(endpoint_id)
        i = self._find(self.row, key)
        if i is None:
            base = self.row * _ROW + _HEAD
            for d in range(PROBE):
                j = (key + d) % ENDPOINTS
                at = base + j * _ENTRY
                if self.buf[at] == 0 or (self.buf[at + 1] == 0 and now * 1e6 - self.buf[at + 3] > PEAK_WINDOW * 1e6):
                    i = j
                    break
            else:
                return None
            self.buf[at + 1] = self.buf[at + 2] = self.buf[at + 3] = 0
            self.buf[at] = key
            # The entry may have been another endpoint's: forget the id that pointed to it.
            self._slots = {e: n for e, n in self._slots.items() if n != i}
        self._slots[endpoint_id] = i
        return i

    def publish(self, endpoint_id: str, before: int, after: int, now: float) -> None:
        """Our count on the endpoint changed from `before` to `after` at `now` (monotonic seconds)."""
        if after < before:  # a slot freed: the siblings' queues may go (`releases`)
            self.buf[self.row * _ROW + 1] += 1
        i = self._slot(endpoint_id, now)
        if i is None:
            return
        at = self.row * _ROW + _HEAD + i * _ENTRY
        us = int(now * 1e6)
        if us - self.buf[at + 3] > PEAK_WINDOW * 1e6:
            self.buf[at + 2] = max(before, after)
            self.buf[at + 3] = us
        elif after > self.buf[at + 2]:
            self.buf[at + 2] = after
        self.buf[at + 1] = after

    def set_connections(self, n: int) -> None:
        """Our worker holds `n` client connections open now."""
        self.buf[self.row * _ROW + 2] = n

    def fewest_connections(self) -> int | None:
        """The fewest client connections a live sibling worker holds (None: no sibling)."""
        held = [self.buf[r * _ROW + 2] for r in range(self.rows) if r != self.row and self.buf[r * _ROW] > 0]
        return min(held) if held else None

    def releases(self) -> int:
        """How many requests the sibling workers have released so far (it grows when one frees a
        slot: what a worker's queued requests watch for, gateway.server.background)."""
        return sum(self.buf[r * _ROW + 1] for r in range(self.rows) if r != self.row and self.buf[r * _ROW] != 0)

    def others(self, endpoint_ids, now: float, *, recent: bool = False) -> dict[str, int]:
        """What the sibling workers hold on each endpoint now, or with `recent`, the most each held in
        the last PEAK_WINDOW seconds (what they may have held when a scrape was taken)."""
        out: dict[str, int] = {}
        keys = [(e, self._key(e)) for e in endpoint_ids]
        us = now * 1e6
        for r in range(self.rows):
            if r == self.row or self.buf[r * _ROW] == 0:
                continue
            base = r * _ROW + _HEAD
            for e, key in keys:
                i = self._find(r, key)
                if i is None:
                    continue
                at = base + i * _ENTRY
                n = self.buf[at + 1]
                if recent and us - self.buf[at + 3] <= PEAK_WINDOW * 1e6:
                    n = max(n, self.buf[at + 2])
                if n > 0:
                    out[e] = out.get(e, 0) + n
        return out


class _Deciding:
    __slots__ = ("lock", "held")

    def __init__(self, lock):
        self.lock, self.held = lock, False

    def __enter__(self) -> "_Deciding":
        self.held = self.lock.acquire(timeout=DECIDE_WAIT)
        return self

    def __exit__(self, *exc) -> None:
        if self.held:
            self.lock.release()


def setup(rows: int) -> SharedCounts | None:
    """In the gunicorn master, before the workers fork: a table of `rows` rows (0: none)."""
    return SharedCounts.create(rows) if rows > 0 else None


def attach(table: SharedCounts | None, row: int | None) -> SharedCounts | None:
    """In a worker right after the fork: the view through its own row (None: it counts alone)."""
    if table is None or row is None:
        return None
    view = table.for_row(row)
    view.adopt(os.getpid())
    return view


# The view a gunicorn worker hands the app factory while gunicorn makes its app (`handing`).
_HANDED: contextvars.ContextVar[SharedCounts | None] = contextvars.ContextVar("llmgw_siblings", default=None)


@contextmanager
def handing(view: SharedCounts | None) -> Iterator[None]:
    """While the worker makes its app: `handed()` is `view`."""
    token = _HANDED.set(view)
    try:
        yield
    finally:
        _HANDED.reset(token)


def handed() -> SharedCounts | None:
    """The worker's view of its row, while its app is being made (`handing`); None otherwise."""
    return _HANDED.get()
