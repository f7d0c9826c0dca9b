"""Eviction across gateways, pure: the ask a waiting request posts for the other gateways, and which
asks a gateway answers with one of its own answers (`answer`).

Within a gateway, a request that ranks first evicts any of its workers' answers (gateway.server.board).
Behind a load balancer the slots of a replica are held by several gateways' answers, and a request
that finds only the others' answers there used to wait for one to end. So when eviction finds nothing
of its own gateway's to take, the request posts an *ask* (its class, key, counter, the cost of one of
its requests, its slack and where it may go) through Redis; every other gateway's workers look at the
asks for the models they run answers of, decide with the same `evict` over their own answers, and
the first to claim the ask (a key set once) pauses its victim. The claim names the victim's endpoint:
the asker routes there at once (`granted`), without waiting to see the slot free in the next report.

Counters compare across gateways as they do across workers: the fair-share exchange keeps each key's
counter the same everywhere within about two intervals (LLMGW_GATEWAY_SHARE_FAIRNESS).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping

from gateway.routing import eviction as ev
from llmgw.state.keypolicy import PRIORITY_RANK

# Seconds (wall clock) after which an ask nobody refreshed is ignored: its worker stopped asking or died.
# An asker refreshes its asks at every look (LLMGW_GATEWAY_EVICT_REMOTE), so this only bounds the dead.
STALE = 2.0
# Seconds a claim's endpoint stays the asker's to route to; unused by then (another request took that
# slot, or the victim ended before it was paused), the request asks again.
GRANT_FOR = 1.0


@dataclass(frozen=True)
class Ask:
    """A waiting request's ask, as the other gateways read it."""

    asker: str  # the worker that posted it: "<its gateway>/<pid>"
    origin: str  # its gateway (the board handles a gateway's own workers)
    model: str
    seq: int  # the asker's count of its asks for this model: one claim per seq
    waiting: ev.Waiting
    at: float  # wall clock when it was last refreshed


def encode(a: Ask) -> str:
    w = a.waiting
    return json.dumps({"o": a.origin, "s": a.seq, "k": w.klass, "y": w.key, "c": w.counter, "t": w.turn,
                       "e": sorted(w.endpoints) if w.endpoints is not None else None, "l": w.slack, "a": a.at},
                      separators=(",", ":"))


def decode(asker: str, model: str, raw: str | bytes) -> Ask | None:
    """The ask stored under `asker` for `model`, or None when it does not parse (written by another
    version, or cut): an ask is a hint, and one that cannot be read is not answered."""
    try:
        d = json.loads(raw)
        w = ev.Waiting(str(d["k"]), str(d["y"]), float(d["c"]), float(d["t"]),
                       frozenset(map(str, d["e"])) if d["e"] is not None else None,
                       float(d["l"]) if d["l"] is not None else None)
        return Ask(asker, str(d["o"]), model, int(d["s"]), w, float(d["a"]))
    except (ValueError, KeyError, TypeError):
        return None


def answer(asks: Iterable[Ask], origin: str, running: Mapping[str, list[ev.Running]], s: ev.Settings,
           now: float, counter: Callable[[str, str], float] = lambda model, key: float("-inf")
           ) -> list[tuple[Ask, ev.Evict]]:
    """Which of our answers (`running`, per model) each fresh ask of another gateway evicts: the asks
    that rank first (class, then the key least served) choose first, and no answer goes to two asks.

    `counter(model, key)`: our own view of a key's fair-share counter. The asking key counts as the more
    served of its gateway's view and ours: each view lags the other gateway's charges by up to two
    exchanges, and the running answers' counters are ours. Compared with the asker's view alone, a
    heavy key whose gateway had not seen its latest charges yet evicted a light key's answer here
    (`bench.preempt --gateways 2`: "131 behind" a key it did not trail)."""
    fresh = [_as_seen(a, counter) for a in asks if a.origin != origin and now - a.at <= STALE and a.model in running]
    fresh.sort(key=lambda a: (-PRIORITY_RANK.get(a.waiting.klass, 1), a.waiting.counter, a.asker))
    taken: set[int] = set()
    out: list[tuple[Ask, ev.Evict]] = []
    for a in fresh:
        got = ev.evict(a.waiting, [r for r in running[a.model] if r.ident not in taken], s)
        if isinstance(got, ev.Evict):
            taken.add(got.victim.ident)
            out.append((a, got))
    return out


def _as_seen(a: Ask, counter: Callable[[str, str], float]) -> Ask:
    w = a.waiting
    ours = counter(a.model, w.key) if w.key else float("-inf")
    return a if ours <= w.counter else replace(a, waiting=replace(w, counter=ours))


@dataclass(frozen=True)
class Mine:
    """The ask of this worker's first waiting request for a model."""

    owner: object  # the waiting request's own eviction state (gateway.http.admit): who may use the grant
    waiting: ev.Waiting
    seq: int
    granted: str | None = None  # the endpoint a claim named
    granted_at: float = 0.0  # (monotonic)


class Asks:
    """A worker's asks, between its waiting requests (`ask`, `granted`, `withdraw`: no I/O) and its
    look (gateway.server.remote_evictions: `due`, `claimed`), under one lock."""

    def __init__(self, asker: str, origin: str):
        self.asker, self.origin = asker, origin
        self.lock = threading.Lock()
        self.mine: dict[str, Mine] = {}  # model -> its ask
        self.withdrawn: set[str] = set()  # models whose ask ended since the last look
        self._seq = 0
        self.changed = threading.Event()  # set when an ask is posted: the look wakes
        self.peers = False  # another gateway shares with this one (set by the look): else nobody to ask

    @property
    def busy(self) -> bool:
        return bool(self.mine or self.withdrawn)

    def ask(self, model: str, waiting: ev.Waiting, owner: object) -> None:
        """`owner`, first in `model`'s queue here, found nothing of its gateway's to evict: ask the others."""
        with self.lock:
            m = self.mine.get(model)
            if m is not None and m.owner is owner:
                if m.waiting != waiting:
                    self.mine[model] = replace(m, waiting=waiting)
            else:
                self._seq += 1
                self.mine[model] = Mine(owner, waiting, self._seq)
                self.withdrawn.discard(model)
        self.changed.set()

    def granted(self, model: str, owner: object, now: float) -> str | None:
        """The endpoint another gateway freed a slot on for `owner`'s ask, while it is its to take."""
        m = self.mine.get(model)
        if m is None or m.owner is not owner or m.granted is None or now - m.granted_at > GRANT_FOR:
            return None
        return m.granted

    def withdraw(self, model: str, owner: object) -> None:
        """`owner` left the queue (it routed, timed out or its client left): its ask ends."""
        with self.lock:
            m = self.mine.get(model)
            if m is not None and m.owner is owner:
                del self.mine[model]
                self.withdrawn.add(model)

    def due(self, wall: float, now: float) -> tuple[dict[str, str], list[str], list[tuple[str, int]]]:
        """What the look writes and reads for this worker: (the asks to post, refreshed to `wall`; the
        models whose asks to take back; the (model, seq) claims to read). A grant unused for GRANT_FOR
        is dropped and asked again under a new seq."""
        with self.lock:
            for model, m in list(self.mine.items()):
                if m.granted is not None and now - m.granted_at > GRANT_FOR:
                    self._seq += 1
                    self.mine[model] = Mine(m.owner, m.waiting, self._seq)
            post = {model: encode(Ask(self.asker, self.origin, model, m.seq, m.waiting, wall))
                    for model, m in self.mine.items() if m.granted is None}
            claims = [(model, m.seq) for model, m in self.mine.items() if m.granted is None]
            withdrawn = sorted(self.withdrawn)
            self.withdrawn.clear()
        return post, withdrawn, claims

    def took_back(self, models: Iterable[str]) -> None:
        """The look could not take these asks back (Redis failed): the next one does, unless asked again."""
        with self.lock:
            self.withdrawn.update(m for m in models if m not in self.mine)

    def claimed(self, model: str, seq: int, endpoint: str, now: float) -> bool:
        """A claim on our ask `seq` named `endpoint`: True when it grants a request still asking."""
        with self.lock:
            m = self.mine.get(model)
            if m is None or m.seq != seq or m.granted is not None:
                return False
            self.mine[model] = replace(m, granted=endpoint, granted_at=now)
            return True
