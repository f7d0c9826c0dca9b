"""Eviction across gateways, the shell (the decision is gateway.routing.remote_eviction's): each worker
looks every `look` seconds (LLMGW_GATEWAY_EVICT_REMOTE, 0.02) while it asks or runs answers that may
be evicted, and only while another gateway shares with it (gateway.server.sendshare sees one):

- in one round trip it posts its asks (the request first in a model's queue here that found nothing of
  its own gateway's to evict), takes back the asks that ended, reads the claims on its asks, and reads
  the other workers' asks for the models it runs answers of;
- a claim grants its request the victim's endpoint (`Asks.claimed`), and the model's queue wakes;
- for the asks of another gateway that outrank one of its answers (`answer`), it claims the ask (one
  key set once: no two workers evict for one ask) and pauses the answer, which resumes word for word
  here when a slot frees, as any evicted answer.

A pass that has nothing to post, take back or read costs no I/O, and so does every pass of a lone gateway. When Redis fails, the pass is
skipped (the failure logged once) and the requests wait as they would without it.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from gateway.observe.health import REDIS_ERRORS
from gateway.routing import eviction as ev
from gateway.routing.remote_eviction import Asks, answer, decode
from llmgw.state.clock import Clock
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

IDLE_LOOK = 0.1  # seconds between checks, while this worker neither asks nor runs answers
# Seconds the victim's slot stays counted as ours after we paused it for another gateway's request: that
# request takes it at the asker's next look, and its gateway reports it within an exchange
# (LLMGW_GATEWAY_SHARE_SENDS). Until then our own waiting requests would see the slot free and take it.
LEND = 0.5


class Answers(Protocol):
    """This worker's answers that may be evicted (gateway.http.evictions.Evictions)."""

    settings: ev.Settings

    @property
    def busy(self) -> bool: ...

    def models(self) -> set[str]: ...

    def running_all(self) -> dict[str, list[ev.Running]]: ...

    def evict_for(self, ident: int, reason: str) -> bool: ...

    def counter(self, model: str, key: str) -> float: ...


class RemoteEvictions:
    """`peers()`: whether another gateway shares with this one; `wake(model)`: the model's queues try
    again; `lend(endpoint)`: hold a slot there for another gateway's request (gateway.routing.router.Router.lend)."""

    def __init__(self, store: Store, asks: Asks, answers: Answers, clock: Clock, look: float,
                 peers: Callable[[], bool], wake: Callable[[str], None],
                 lend: Callable[[str], Callable[[], None] | None]):
        self.store, self.asks, self.answers, self.clock, self.look = store, asks, answers, clock, look
        self.peers, self.wake, self.lend = peers, wake, lend
        self.lent: list[tuple[float, Callable[[], None]]] = []  # (until, give back), oldest first
        self.stopping = threading.Event()
        self._failing = False

    def start(self) -> None:
        if self.look > 0 and self.answers.settings.enabled:
            threading.Thread(target=self._loop, name="llmgw-remote-evictions", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()
        self.asks.changed.set()

    def _loop(self) -> None:
        asks, answers = self.asks, self.answers
        while not self.stopping.is_set():
            asks.peers = self.peers()
            if not (asks.busy or answers.busy or self.lent):
                asks.changed.wait(IDLE_LOOK)
                asks.changed.clear()
                continue
            self.stopping.wait(self.look)
            try:
                self.step()
                if self._failing:
                    log.info("exchanging eviction asks with the other gateways again")
                self._failing = False
            except REDIS_ERRORS as e:
                if not self._failing:
                    log.warning("exchanging eviction asks with the other gateways failed: %s", e)
                self._failing = True
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("exchanging eviction asks with the other gateways failed")
                self.stopping.wait(1.0)
        self.close()

    def step(self) -> int:
        """One look; returns how many of our answers it paused for the other gateways' asks."""
        asks, now = self.asks, self.clock.monotonic()
        wall = self.clock.time()
        while self.lent and self.lent[0][0] <= now:
            self.lent.pop(0)[1]()
        post, withdrawn, claims = asks.due(wall, now)
        asks.peers = self.peers()
        if not asks.peers:  # alone: nobody reads our asks or asks us
            return 0
        models = self.answers.models()
        if not (post or withdrawn or claims or models):
            return 0
        try:
            theirs, made = self.store.exchange_evict_asks(asks.asker, post, withdrawn, models, claims)
        except Exception:
            asks.took_back(withdrawn)  # not taken back in Redis yet: the next look does it
            raise
        for (model, seq), endpoint in made.items():
            if asks.claimed(model, seq, endpoint, now):
                self.wake(model)
        read = [a for model, raw in theirs.items() for asker, v in raw.items()
                if asker != asks.asker and (a := decode(asker, model, v)) is not None]
        if not read:
            return 0
        paused = 0
        for a, got in answer(read, asks.origin, self.answers.running_all(), self.answers.settings, wall,
                             self.answers.counter):
            if self.store.claim_evict_ask(a.asker, a.model, a.seq, got.victim.endpoint):
                give_back = self.lend(got.victim.endpoint)  # (before the victim gives its slot back)
                if give_back is not None:
                    self.lent.append((now + LEND, give_back))
                reason = f"a waiting request of another gateway outranks it: {got.reason}"
                paused += self.answers.evict_for(got.victim.ident, reason)
        return paused

    def close(self) -> None:
        """Give back every slot still lent (the loop stopped)."""
        while self.lent:
            self.lent.pop(0)[1]()
