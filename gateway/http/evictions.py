"""Eviction's shell: this worker's answers that may be evicted, and `consider`, which a waiting request
that ranks first calls when its model is saturated: it reads what runs (here, and in the sibling
workers through the shared board, gateway.server.board), asks the pure `gateway.routing.eviction.evict`,
and tells the victim's stream to pause (gateway.http.resume.ResumingBody.evict). The victim's engine
request is closed, the engine frees its slot, and the waiting request, first in line, takes it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Callable, Protocol

from gateway.observe.metrics import Metrics
from gateway.request.call import Call
from gateway.request.plan import Plan
from gateway.routing import eviction as ev
from gateway.routing.fairness import estimate, output_estimate, prompt_estimate
from gateway.routing.ledger import Ledger
from gateway.routing.remote_eviction import Asks
from gateway.routing.tables import Tables
from llmgw.state.clock import Clock
from llmgw.state.keypolicy import PRIORITY_RANK

if TYPE_CHECKING:
    from gateway.server.board import Board

log = logging.getLogger("llmgw.gateway")


class Evictable(Protocol):
    """What eviction reads of a running answer, and how it is told to pause (ResumingBody)."""

    def running(self, ident: int, counter: Callable[[str], float], now: float) -> ev.Running: ...

    def brief(self) -> tuple[str, int, float, int, bool]:
        """(endpoint, tokens so far, when it started there, evictions, fixed): cheap, no parsing."""

    @property
    def holding(self) -> bool:
        """It holds a slot (it runs, or is being evicted and has not given it back yet)."""

    def evict(self, reason: str) -> None: ...


class Evictions:
    """Answers of this worker that may be evicted. `model_of(name)`: the model whose counters order a
    requested name's queue (gateway.routing.queue.WaitQueues.model_of)."""

    def __init__(self, settings: ev.Settings, clock: Clock, ledger: Ledger, model_of: Callable[[str], str],
                 metrics: Metrics, board: "Board | None" = None, asks: Asks | None = None):
        self.settings, self.clock, self.ledger, self.model_of, self.metrics = settings, clock, ledger, model_of, metrics
        self.board = board  # the sibling workers' answers (gateway.server.board; None: this worker alone)
        # This worker's asks to the other gateways (gateway.routing.remote_eviction; None: it asks none)
        self.asks = asks
        self.lock = threading.Lock()
        self.answers: dict[int, tuple[str, Evictable]] = {}  # ident -> (model, answer)
        self._ids = itertools.count(1)
        self.last: dict[str, ev.Keep | ev.Evict] = {}  # model -> the last decision, for `llmgw explain`
        self.listed = threading.Event()  # set when an answer is added: the flag loop wakes
        self._asked = 0  # evictions the other workers had asked of ours at the last look

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def add(self, model: str, answer: Evictable) -> int:
        ident = next(self._ids)
        model = self.model_of(model)
        with self.lock:
            self.answers[ident] = (model, answer)
        board = self.board
        if board is not None:
            endpoint, _, started, _, _ = answer.brief()
            board.list_answer(ident, model, endpoint, PRIORITY_RANK.get(answer.klass, 1), answer.key, started)
        self.listed.set()
        return ident

    @property
    def busy(self) -> bool:
        return bool(self.answers)

    def changed(self, ident: int, answer: Evictable) -> None:
        """An answer paused or went on: the sibling workers see it at once."""
        board = self.board
        if board is not None:
            board.update_answer(ident, *answer.brief())

    def remove(self, ident: int) -> None:
        with self.lock:
            self.answers.pop(ident, None)
        board = self.board
        if board is not None:
            board.unlist_answer(ident)

    def look(self) -> None:
        """The flag loop's look (gateway.server.background, every EVICT_LOOK seconds while answers
        run): the answers another worker asked to evict are paused. One read when none was asked."""
        board = self.board
        if board is None:
            return
        asked = board.evictions_asked()
        if asked == self._asked:
            return
        self._asked = asked
        now = self.clock.monotonic()
        for ident in board.flagged():
            with self.lock:
                entry = self.answers.get(ident)
            if entry is None:
                continue
            r = entry[1].running(ident, lambda key: 0.0, now)
            if r.fixed is not None:  # (reasoning or a tool call began since it was offered)
                board.refuse(ident)
                continue
            log.info("evicting answer %d on %s (%d tokens) for a sibling worker's waiting request", ident,
                     r.endpoint, r.tokens)
            entry[1].evict("a sibling worker's waiting request outranks it")

    def publish(self) -> None:
        """What the board shows of our answers, brought up to date (the tokens each generated, where
        it runs now): the flag loop calls it every EVICT_REFRESH seconds."""
        board = self.board
        if board is None:
            return
        with self.lock:
            mine = list(self.answers.items())
        for ident, (_, answer) in mine:
            board.update_answer(ident, *answer.brief())

    def running(self, model: str) -> list[ev.Running]:
        """The answers of `model` running in this worker, as eviction reads them."""
        now, counter = self.clock.monotonic(), self._counter(model)
        with self.lock:
            mine = [(i, a) for i, (m, a) in self.answers.items() if m == model and a.holding]
        return [a.running(i, counter, now) for i, a in mine]

    def models(self) -> set[str]:
        """The models this worker runs answers of that may be evicted."""
        with self.lock:
            return {m for m, a in self.answers.values() if a.holding}

    def running_all(self) -> dict[str, list[ev.Running]]:
        """This worker's answers that hold a slot, per model, as eviction reads them."""
        now = self.clock.monotonic()
        with self.lock:
            mine = [(i, m, a) for i, (m, a) in self.answers.items() if a.holding]
        out: dict[str, list[ev.Running]] = {}
        for i, m, a in mine:
            out.setdefault(m, []).append(a.running(i, self._counter(m), now))
        return out

    def evict_for(self, ident: int, reason: str) -> bool:
        """Pause our answer `ident` for another gateway's request (gateway.server.remote_evictions)."""
        with self.lock:
            entry = self.answers.get(ident)
        if entry is None:
            return False
        model, answer = entry
        log.info("evicting answer %d for another gateway's waiting request (%s)", ident, reason)
        answer.evict(reason)
        self.metrics.child(self.metrics.evictions, model).inc()
        return True

    def granted(self, model: str, owner: object) -> str | None:
        """The endpoint where another gateway paused an answer for `owner` (the waiting request's
        eviction state), while it is its to take."""
        asks = self.asks
        return asks.granted(self.model_of(model), owner, self.clock.monotonic()) if asks is not None else None

    def withdraw(self, model: str, owner: object) -> None:
        """`owner` left its queue: its ask to the other gateways, if any, ends."""
        if self.asks is not None:
            self.asks.withdraw(self.model_of(model), owner)

    def counter(self, model: str, key: str) -> float:
        """This worker's view of `key`'s fair-share counter on `model` (gateway.routing.ledger)."""
        return self.ledger.counter(model, key)

    def _counter(self, model: str) -> Callable[[str], float]:
        led = self.ledger
        return lambda key: led.counter(model, key)

    def waiting(self, call: Call, plan: Plan, endpoints: frozenset[str] | None,
                slack: float | None = None) -> ev.Waiting:
        model = self.model_of(call.model)
        tenant = plan.tenant
        key = tenant.key if tenant is not None else ""
        turn = self.ledger.turns.get((model, key))
        if turn is None:  # its key's first request: what this one is expected to cost
            body = call.body or {}
            most = body.get("max_tokens") or body.get("max_completion_tokens")
            turn = estimate(prompt_estimate(plan.prompt_tokens, len(call.data or b"")), 0.0,
                            output_estimate(most, None, True), self.ledger.output_weight)
        weight = tenant.weight if tenant is not None else 1.0
        return ev.Waiting(plan.priority, key, self.ledger.counter(model, key) if key else 0.0, turn / weight, endpoints,
                          slack)

    def decide(self, call: Call, plan: Plan, tables: Tables, exclude: frozenset[str],
               slack: float | None = None) -> ev.Evict | ev.Keep:
        """What eviction says for a request of a saturated model (pure, over what runs now); `slack`:
        what its first-byte target leaves it (gateway.routing.slo.slack; None: no target)."""
        return self._decide(call, plan, tables, exclude, slack)[1]

    def _decide(self, call: Call, plan: Plan, tables: Tables, exclude: frozenset[str],
                slack: float | None) -> tuple[ev.Waiting | None, ev.Evict | ev.Keep]:
        if not self.settings.enabled:
            return None, ev.Keep("eviction is off (LLMGW_GATEWAY_EVICT=0)")
        model = self.model_of(call.model)
        w = self.waiting(call, plan, serving(tables, call.model, exclude), slack)
        running = self.running(model)
        board = self.board
        if board is not None:
            eps = serving(tables, call.model, frozenset()) or ()
            running += board.running(model, self._counter(model), self.clock.monotonic(), eps)
        got = ev.evict(w, running, self.settings)
        self.last[model] = got
        return w, got

    def consider(self, call: Call, plan: Plan, tables: Tables, exclude: frozenset[str],
                 pending: set[int], slack: float | None = None) -> float | None:
        """A waiting request that ranks first found its model saturated: evict the answer eviction
        names, unless one it evicted already has not given its slot back yet (`pending`, its own).
        Returns when to look again, when an answer it outranks will soon be evictable."""
        board = self.board
        with self.lock:
            holding = {i for i, (_, a) in self.answers.items() if a.holding}
        pending -= {i for i in pending if i > 0 and i not in holding}  # (the slot it freed was given back)
        if any(i > 0 for i in pending) or (board is not None and board.pending({i for i in pending if i < 0})):
            return None
        pending.clear()
        w, got = self._decide(call, plan, tables, exclude, slack)
        if not isinstance(got, ev.Evict):
            if w is not None and self.asks is not None and self.asks.peers:  # nothing of ours: ask the others
                model = self.model_of(call.model)
                self.asks.ask(model, w, pending)
                self.last[model] = ev.Keep(f"{got.reason}; asked the other gateways", got.retry_in)
            return got.retry_in
        victim = got.victim
        pending.add(victim.ident)
        with self.lock:
            entry = self.answers.get(victim.ident)
        if entry is not None:
            log.info("evicting answer %d on %s (%d tokens; %s) for a waiting %s request", victim.ident,
                     victim.endpoint, victim.tokens, got.reason, plan.priority)
            entry[1].evict(got.reason)
        elif board is not None:
            board.evict(victim.ident)  # a sibling worker's: it pauses it at its next look
        self.metrics.child(self.metrics.evictions, plan.canon).inc()
        return None


def serving(tables: Tables, model: str, exclude: frozenset[str]) -> frozenset[str] | None:
    """The endpoints a request for `model` may be sent to (an adapter's: those holding it)."""
    ad = tables.adapters.get(model) if tables.adapters else None
    if ad is not None:
        return frozenset(e.id for e in ad.holders if e.id not in exclude)
    canon = tables.canonical.get(model, model)
    return frozenset(e.id for e in tables.endpoints if canon in e.models and e.id not in exclude)
