"""What the gunicorn workers of one gateway tell each other of their waiting and running requests, so
that they keep one order and may evict each other's answers (gateway.routing.eviction).

- **One order.** Each worker's queue keeps its own waiters in fair order (gateway.routing.queue); when a
  slot frees, every worker's head would race for it. So each worker publishes the head of each of its
  queues here (its class, its key's fair-share counter as that worker sees it, how many of its key
  wait, when it arrived), and a head routes only when no other worker's head for the same model ranks
  before it (`first`): the slot goes to the request that ranks first among every worker's waiting
  requests. Heads compare what each published (their counters agree within the fair-share exchange,
  LLMGW_GATEWAY_SHARE_FAIRNESS). A head not refreshed for STALE seconds (its worker died, or it left)
  is ignored.
- **Answers of the other workers.** Each worker lists its running answers that may be evicted (their
  model, endpoint, class, key, tokens so far, start, evictions). A waiting request reads them with its
  own, and evicts one of another worker's by flagging it (`evict`); that worker's loop looks at its
  flags every EVICT_LOOK seconds while it has answers running (`flagged`) and pauses the answer.

Like the sibling table (gateway.server.siblings), an anonymous shared memory map the gunicorn master
makes before it forks, one row per worker, each part written by its worker alone but the eviction
flags (an aligned 8-byte store: not torn). No lock: a reader may see an entry being written, and
judges it again at its next look.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from typing import Callable, Iterable

from gateway.routing import eviction as ev

RUN_MAX = 1024  # running answers one worker lists (more are not offered to the other workers)
WAIT_MAX = 64  # queue heads one worker publishes (one per model with waiters)
# Seconds after which a head not refreshed is ignored: its worker hung or died (a replaced worker clears
# its row when it adopts it). A waiting head looks again at least every second (queue.RECHECK); on a
# machine loaded past its cores a thread can wait seconds to run, and a live head taken for stale
# loses its turn to a younger request of its own key (2.5 s did, in the suite at 3x the cores).
STALE = 10.0
# A head due soon publishes a counter below this (gateway.routing.queue.URGENT_COUNTER, -1e12 plus its due
# time): not a key's counter.
URGENT_MAX = -1e11
EVICT_LOOK = 0.01  # seconds between a worker's looks at its eviction flags while it has answers running

_HEAD = 4  # owner pid (0: free), evictions asked of this worker (grows), running listed, heads listed
_KEY = 4  # int64s of a key id (32 bytes, ascii)
# ident, model, endpoint, class rank, key (4), tokens, started (us), evictions, fixed, flag
_RUN = 9 + _KEY
# model, class rank, counter (float64 bits), its key's waiting, arrival (us), refreshed (us), key (4), queue length
_WAIT = 7 + _KEY
_ROW = _HEAD + RUN_MAX * _RUN + WAIT_MAX * _WAIT
_D = struct.Struct("d")
_Q = struct.Struct("q")


def hash_of(name: str) -> int:
    """A nonzero 63-bit key for a model or endpoint name."""
    return (int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 1) or 1


def _bits(x: float) -> int:
    return _Q.unpack(_D.pack(x))[0]


def _float(q: int) -> float:
    return _D.unpack(_Q.pack(q))[0]


def _key_ints(key: str) -> list[int]:
    raw = key.encode()[:_KEY * 8].ljust(_KEY * 8, b"\0")
    return [int.from_bytes(raw[i * 8:(i + 1) * 8], "little", signed=True) for i in range(_KEY)]


def _key_str(ints) -> str:
    return b"".join(int(i).to_bytes(8, "little", signed=True) for i in ints).rstrip(b"\0").decode(errors="replace")


class Board:
    """A view of the board from one worker (`row`), or from the master (`row` None)."""

    def __init__(self, buf, rows: int, row: int | None = None):
        self.raw = buf
        self.buf = memoryview(buf).cast("q")
        self.rows, self.row = rows, row
        self._hashes: dict[str, int] = {}
        self._slots: dict[int, int] = {}  # our answer's ident -> its entry
        self._heads: dict[str, int] = {}  # model -> the entry of our queue's head
        self._where: dict[int, tuple[int, int]] = {}  # another worker's answer, as `running` named it -> (row, its ident)

    @classmethod
    def create(cls, rows: int) -> "Board":
        return cls(mmap.mmap(-1, rows * _ROW * 8), rows)

    def for_row(self, row: int) -> "Board":
        return Board(self.raw, self.rows, row)

    def _hash(self, name: str) -> int:
        h = self._hashes.get(name)
        if h is None:
            if len(self._hashes) > 4096:
                self._hashes.clear()
            h = self._hashes[name] = hash_of(name)
        return h

    # --- the master -------------------------------------------------------------------------------
    def clear(self, row: int) -> None:
        """A worker's row, emptied (it started, or it exited: its answers and waiters went with it)."""
        base = row * _ROW
        self.buf[base:base + _ROW] = memoryview(bytes(_ROW * 8)).cast("q")

    # --- a worker's own entries ---------------------------------------------------------------------
    def adopt(self, pid: int) -> None:
        self.clear(self.row)
        self.buf[self.row * _ROW] = pid

    def _base(self, row: int) -> int:
        return row * _ROW

    def list_answer(self, ident: int, model: str, endpoint: str, rank: int, key: str, started: float) -> None:
        """One of our answers may be evicted: offer it to the other workers."""
        base = self._base(self.row)
        n = self.buf[base + 2]
        if n >= RUN_MAX:
            return
        at = base + _HEAD + n * _RUN
        b = self.buf
        b[at + 1], b[at + 2], b[at + 3] = self._hash(model), self._hash(endpoint), rank
        b[at + 4:at + 4 + _KEY] = memoryview(struct.pack(f"{_KEY}q", *_key_ints(key))).cast("q")
        i = at + 4 + _KEY
        b[i], b[i + 1], b[i + 2], b[i + 3], b[i + 4] = 0, int(started * 1e6), 0, 0, 0
        b[at] = ident
        self._slots[ident] = n
        b[base + 2] = n + 1

    def update_answer(self, ident: int, endpoint: str, tokens: int, started: float, evictions: int,
                      fixed: bool) -> None:
        """What the other workers read of one of our answers, as it is now."""
        n = self._slots.get(ident)
        if n is None:
            return
        at = self._base(self.row) + _HEAD + n * _RUN
        i = at + 4 + _KEY
        b = self.buf
        b[at + 2] = self._hash(endpoint)
        b[i], b[i + 1], b[i + 2], b[i + 3] = tokens, int(started * 1e6), evictions, int(fixed)

    def unlist_answer(self, ident: int) -> None:
        n = self._slots.pop(ident, None)
        if n is None:
            return
        base = self._base(self.row)
        last = self.buf[base + 2] - 1
        at, last_at = base + _HEAD + n * _RUN, base + _HEAD + last * _RUN
        if n != last:  # the last entry moves into the hole: the list stays packed
            self.buf[at:at + _RUN] = self.buf[last_at:last_at + _RUN]
            moved = self.buf[at]
            self._slots[moved] = n
        self.buf[last_at:last_at + _RUN] = memoryview(bytes(_RUN * 8)).cast("q")
        self.buf[base + 2] = last

    def refuse(self, ident: int) -> None:
        """One of our answers may not be evicted after all (found when asked): say so."""
        n = self._slots.get(ident)
        if n is not None:
            self.buf[self._base(self.row) + _HEAD + n * _RUN + 7 + _KEY] = 1

    def flagged(self) -> list[int]:
        """Our answers another worker asked to evict (their flags are cleared)."""
        base = self._base(self.row)
        out = []
        for n in range(self.buf[base + 2]):
            at = base + _HEAD + n * _RUN
            flag = at + 8 + _KEY
            if self.buf[flag]:
                self.buf[flag] = 0
                out.append(self.buf[at])
        return out

    def evictions_asked(self) -> int:
        """How many evictions the other workers asked of ours so far (it grows)."""
        return self.buf[self._base(self.row) + 1]

    # --- the other workers' answers -----------------------------------------------------------------
    def running(self, model: str, counter: Callable[[str], float], now: float,
                endpoints: Iterable[str]) -> list[ev.Running]:
        """The other workers' answers of `model`, as eviction reads them; `endpoints`: the ids of the
        model's endpoints (an answer is named by its endpoint's hash here)."""
        mh = self._hash(model)
        names = {self._hash(e): e for e in endpoints}
        out = []
        us = now * 1e6
        b = self.buf
        for r in range(self.rows):
            base = self._base(r)
            if r == self.row or b[base] <= 0:
                continue
            for n in range(min(b[base + 2], RUN_MAX)):
                at = base + _HEAD + n * _RUN
                if b[at + 1] != mh:
                    continue
                ep = names.get(b[at + 2])
                if ep is None:
                    continue
                key = _key_str(b[at + 4:at + 4 + _KEY])
                i = at + 4 + _KEY
                fixed = "it is being evicted, or may not be" if b[i + 3] or b[i + 4] else None
                ident = -((r << 32) | b[at])  # negative: never one of this worker's own
                out.append(ev.Running(ident, ep, _class_of(b[at + 3]), key, counter(key) if key else 0.0, b[i],
                                      (us - b[i + 1]) / 1e6, b[i + 2], fixed))
                if len(self._where) > 4 * RUN_MAX:
                    self._where.clear()
                self._where[ident] = (r, b[at])
        return out

    def evict(self, ident: int) -> bool:
        """Ask the worker holding answer `ident` (as `running` named it) to evict it."""
        where = self._where.get(ident)
        if where is None:
            return False
        r, own = where
        base = self._base(r)
        b = self.buf
        for n in range(min(b[base + 2], RUN_MAX)):
            at = base + _HEAD + n * _RUN
            if b[at] == own:
                b[at + 8 + _KEY] = 1
                b[base + 1] += 1
                return True
        return False

    def pending(self, idents: set[int]) -> bool:
        """Whether one of the other workers' answers in `idents` still runs (its slot not given back)."""
        for ident in idents:
            where = self._where.get(ident)
            if where is None:
                continue
            r, own = where
            base = self._base(r)
            b = self.buf
            for n in range(min(b[base + 2], RUN_MAX)):
                at = base + _HEAD + n * _RUN
                if b[at] == own and not b[at + 7 + _KEY]:  # (an answer its worker refused to evict is not)
                    return True
        return False

    # --- one order ----------------------------------------------------------------------------------
    def publish_head(self, model: str, key: str, rank: int, counter: float, waiting: int, arrival: float,
                     now: float, queued: int = 1) -> None:
        """Our queue of `model` has this head now (of `key`'s requests), and `queued` waiters in all."""
        base = self._base(self.row)
        n = self._heads.get(model)
        b = self.buf
        if n is None:
            n = b[base + 3]
            if n >= WAIT_MAX:
                return
            self._heads[model] = n
            b[base + 3] = n + 1
        at = base + _HEAD + RUN_MAX * _RUN + n * _WAIT
        b[at + 1], b[at + 2], b[at + 3], b[at + 4] = rank, _bits(counter), waiting, int(arrival * 1e6)
        b[at + 5] = int(now * 1e6)
        b[at + 6:at + 6 + _KEY] = memoryview(struct.pack(f"{_KEY}q", *_key_ints(key))).cast("q")
        b[at + 6 + _KEY] = queued
        b[at] = self._hash(model)

    def drop_head(self, model: str) -> None:
        """Our queue of `model` has no waiter left."""
        n = self._heads.pop(model, None)
        if n is None:
            return
        base = self._base(self.row)
        b = self.buf
        last = b[base + 3] - 1
        wbase = base + _HEAD + RUN_MAX * _RUN
        at, last_at = wbase + n * _WAIT, wbase + last * _WAIT
        if n != last:
            b[at:at + _WAIT] = b[last_at:last_at + _WAIT]
            for m, i in list(self._heads.items()):
                if i == last:
                    self._heads[m] = n
        b[last_at:last_at + _WAIT] = memoryview(bytes(_WAIT * 8)).cast("q")
        b[base + 3] = last

    def waiting_elsewhere(self, model: str, now: float) -> int:
        """How many requests for `model` wait in the other workers' queues (their heads fresh): a
        request arriving here lines up behind them as behind its own worker's."""
        mh, us, b, total = self._hash(model), now * 1e6, self.buf, 0
        for r in range(self.rows):
            base = self._base(r)
            if r == self.row or b[base] <= 0:
                continue
            wbase = base + _HEAD + RUN_MAX * _RUN
            for n in range(min(b[base + 3], WAIT_MAX)):
                at = wbase + n * _WAIT
                if b[at] == mh and us - b[at + 5] <= STALE * 1e6:
                    total += max(1, b[at + 6 + _KEY])
        return total

    def _fresh_heads(self, base: int, mh: int, us: float):
        """The entries of the row at `base` that are a queue head of the model hashed `mh`, refreshed
        within STALE of `us` (microseconds)."""
        b = self.buf
        wbase = base + _HEAD + RUN_MAX * _RUN
        for n in range(min(b[base + 3], WAIT_MAX)):
            at = wbase + n * _WAIT
            if b[at] == mh and us - b[at + 5] <= STALE * 1e6:
                yield at

    def elsewhere(self, model: str, key: str, now: float) -> tuple[bool, float | None]:
        """What the other workers say of `key` joining a queue of `model` (gateway.routing.ledger.Elsewhere):
        whether one lists a running answer of it or a fresh queue head of it (a key waiting behind
        another key's head there is not seen: the lift it then takes is bounded by one of its requests,
        gateway.routing.fairness.lifted), and the least counter of another key's fresh head (not one
        due soon, which publishes a counter below every other: gateway.routing.queue.URGENT_COUNTER)."""
        mh, kints, us, b = self._hash(model), _key_ints(key), now * 1e6, self.buf
        k0 = kints[0]
        busy, least = False, None
        for r in range(self.rows):
            base = self._base(r)
            if r == self.row or b[base] <= 0:
                continue
            if not busy:
                for n in range(min(b[base + 2], RUN_MAX)):
                    at = base + _HEAD + n * _RUN
                    if b[at + 1] == mh and b[at + 4] == k0 and list(b[at + 4:at + 4 + _KEY]) == kints:
                        busy = True
                        break
            for at in self._fresh_heads(base, mh, us):
                if list(b[at + 6:at + 6 + _KEY]) == kints:
                    busy = True
                elif (c := _float(b[at + 2])) > URGENT_MAX and (least is None or c < least):
                    least = c
        return busy, least

    def first(self, model: str, key: str, rank: int, counter: float, waiting: int, arrival: float,
              now: float) -> bool:
        """Whether our head for `model` (as just published) ranks before every other worker's: the
        highest class, then the least counter, then the fewest of its key waiting, then the oldest; a
        head of the same key, the highest class, then the oldest (first come, first served within a key,
        a continuation being as old as its request)."""
        mh = self._hash(model)
        mine = (-rank, counter, waiting, int(arrival * 1e6), self.row)
        same_key = (-rank, int(arrival * 1e6), self.row)
        kints = _key_ints(key)
        us = now * 1e6
        b = self.buf
        for r in range(self.rows):
            base = self._base(r)
            if r == self.row or b[base] <= 0:
                continue
            for at in self._fresh_heads(base, mh, us):
                if list(b[at + 6:at + 6 + _KEY]) == kints:
                    if (-b[at + 1], b[at + 4], r) < same_key:
                        return False
                elif (-b[at + 1], _float(b[at + 2]), b[at + 3], b[at + 4], r) < mine:
                    return False
        return True


def _class_of(rank: int) -> str:
    from llmgw.state.keypolicy import PRIORITY_RANK

    for name, r in PRIORITY_RANK.items():
        if r == rank:
            return name
    return "standard"


def setup(rows: int) -> Board | None:
    """In the gunicorn master, before the workers fork: a board of `rows` rows (0: none)."""
    return Board.create(rows) if rows > 0 else None


def attach(board: Board | None, row: int | None, pid: int) -> Board | None:
    """In a worker right after the fork: the view through its own row."""
    if board is None or row is None:
        return None
    view = board.for_row(row)
    view.adopt(pid)
    return view
