"""Events drive the control passes; beat's timers are the backstop (docs/lifecycle.md).

A fact that changes what should run or what is routable (a catalog apply, a node joining or being
cordoned, a replica turning Ready or exiting, a stop confirmed, demand for a model at zero) *kicks*
the pass that reacts to it: `Kicker.kick("llmgw.reconcile")`. A kick

- marks the pass dirty (`llmgw:dirty:<task>`), and
- sends the task to the control queue with a short countdown, unless one is already on its way
  (`llmgw:kick:<task>`, SET NX with a TTL): a burst of facts sends one task, not one per fact.

The pass clears both marks when it starts (`Kicker.started`) and, when it ends, kicks itself again
if the dirty mark came back meanwhile (`Kicker.finished`): a fact that arrived after the pass read
its snapshot is never left for the timer. A pass that finds its lock taken marks the pass dirty, so
the running one goes again. Lost kicks (a worker dying with the task) are repaired by the next
timer tick, and a scheduled mark expires by itself.

The rule itself is pure (`KickRule`), so it is tested with a fake clock; `Kicker` applies it to the
marks in Redis (`llmgw.state.store.kicks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

from llmgw.redisurl import celery_conf
from llmgw.state.keys import CONTROL_QUEUE
from llmgw.state.store import RedisError, Store

log = logging.getLogger("llmgw.kicks")

RECONCILE = "llmgw.reconcile"
PUBLISH = "llmgw.publish"

# Seconds a kicked task waits before it runs, gathering the facts of a burst into one pass.
DEBOUNCE = 0.03
# A scheduled mark outlives a lost task by at most this long (seconds).
SCHEDULED_TTL = 2.0
# A dirty mark nobody clears (no pass ever ran) expires after this long (seconds).
DIRTY_TTL = SCHEDULED_TTL * 10


@dataclass(frozen=True)
class KickState:
    """The two marks of one task: a pass is on its way until `scheduled_until`; `dirty` since the
    last pass started."""

    scheduled_until: float = float("-inf")
    dirty: bool = False


class KickRule:
    """Pure: what a kick, a pass start and a pass end do to the marks, and whether to send a task."""

    @staticmethod
    def kick(s: KickState, now: float) -> tuple[KickState, bool]:
        if now < s.scheduled_until:
            return KickState(s.scheduled_until, True), False
        return KickState(now + SCHEDULED_TTL, True), True

    @staticmethod
    def started(s: KickState, now: float) -> KickState:  # noqa: ARG004 - same shape as the others
        return KickState(float("-inf"), False)

    @staticmethod
    def finished(s: KickState, now: float) -> tuple[KickState, bool]:
        if not s.dirty:
            return s, False
        return KickRule.kick(s, now)


class Sender(Protocol):
    def __call__(self, task: str, countdown: float, headers: Mapping[str, str] | None = None) -> None: ...


def celery_sender(app) -> Sender:
    """Send by name on the control queue through a Celery app (the worker's own, or `broker_app`).
    `headers`: message headers, a trace context carrier (the task reads it back with
    `llmgw.tracing.from_task(self.request)`; docs/tracing.md)."""

    def send(task: str, countdown: float, headers: Mapping[str, str] | None = None) -> None:
        app.send_task(task, queue=CONTROL_QUEUE, countdown=countdown or None, headers=dict(headers) if headers else None)

    return send


def broker_app(redis_url: str):
    """A Celery app that only sends (no task modules): for the CLI and the gateway, which kick the
    control passes without being Celery workers. The broker as the workers see it (Sentinel included:
    `llmgw.redisurl.celery_conf`)."""
    from celery import Celery

    conf = celery_conf(redis_url)
    app = Celery("llmgw-kick", broker=conf.pop("broker_url"), set_as_current=False)
    app.conf.update(**conf)
    return app


class Kicker:
    """`KickRule` on Redis. Never raises: a kick that cannot be sent is repaired by the timer."""

    def __init__(self, store: Store | None, send: Sender, debounce: float = DEBOUNCE, enabled: bool = True):
        self.store, self.send, self.debounce, self.enabled = store, send, debounce, enabled

    def kick(self, task: str, headers: Mapping[str, str] | None = None) -> bool:
        """Mark `task` dirty and send it unless one is on its way. True if a task was sent. `headers`
        go with the task sent (a trace context carrier: the pass it kicks is the kicker's child); a
        kick folded into one already on its way carries none."""
        if not self.enabled:
            return False
        try:
            scheduled = self.store.mark_kicked(task, DIRTY_TTL, SCHEDULED_TTL)
            if scheduled:
                if headers:
                    self.send(task, self.debounce, headers)
                else:
                    self.send(task, self.debounce)
            return scheduled
        except Exception as e:  # noqa: BLE001 - the fact is recorded; the timer will catch up
            log.warning("could not kick %s (%s); the periodic pass will run it", task, e)
            return False

    def kick_in(self, task: str, seconds: float) -> None:
        """Send `task` to run in `seconds` (a pass that knows when it must look again: the end of an
        autoscaling window). No marks: passes are idempotent and their lock keeps them apart."""
        if not self.enabled:
            return
        try:
            self.send(task, max(self.debounce, seconds))
        except Exception as e:  # noqa: BLE001 - the timer will catch up
            log.warning("could not schedule %s in %.1fs (%s); the periodic pass will run it", task, seconds, e)

    def started(self, task: str) -> None:
        """A pass of `task` starts: facts from now on need another pass."""
        if not self.enabled:
            return
        try:
            self.store.clear_kick_marks(task)
        except RedisError:
            pass

    def finished(self, task: str) -> bool:
        """A pass of `task` ended: kick again if a fact changed meanwhile. True if it did."""
        if not self.enabled:
            return False
        try:
            dirty = self.store.kick_dirty(task)
        except RedisError:
            return False
        return self.kick(task) if dirty else False

    def mark_dirty(self, task: str) -> None:
        """A pass could not run now (another holds the lock): make the running one go again."""
        if not self.enabled:
            return
        try:
            self.store.mark_kick_dirty(task, DIRTY_TTL)
        except RedisError:
            pass


def disabled() -> Kicker:
    """A Kicker that does nothing (tests of the timers alone, and callers without a broker)."""
    return Kicker(None, lambda task, countdown: None, enabled=False)


KickFn = Callable[[str], object]
