"""Celery beat's schedule for llmgw's control tasks (run exactly one `celery -A workers beat`).

Each entry expires before its next run, so a backlog built up while the control worker was down is
dropped instead of replayed; the tasks' Redis locks keep a slow pass from overlapping the next one.

Celery turns a relative `expires` into an absolute time on the sender's clock (beat's `app.now()` plus
the seconds) and the worker revokes a message whose expiry is behind its own clock. So a control
worker whose clock runs ahead of beat's by more than `expires` (0.9 s for publish) silently drops
every run: beat and the control workers need synchronised clocks (NTP), see docs/control-plane.md.
"""

from __future__ import annotations

from llmgw.batch.config import BatchSettings
from llmgw.batch.kick import SWEEP_TASK
from llmgw.settings import ControlSettings
from llmgw.state.keys import BATCH_QUEUE, CONTROL_QUEUE

HOUSEKEEPING_INTERVAL = 30.0  # seconds; cheap tidying (docs/control-plane.md)
# Expiry as a share of the interval: below 1 so a backlog never replays, as high as that allows so
# the tolerance for queueing delay plus clock skew between beat and the worker is as large as it can be.
EXPIRES_SHARE = 0.9


def beat_schedule(settings: ControlSettings, batch: BatchSettings | None = None) -> dict:
    def entry(task: str, every: float, queue: str = CONTROL_QUEUE) -> dict:
        return {"task": task, "schedule": every, "options": {"queue": queue, "expires": every * EXPIRES_SHARE}}

    batch = batch or BatchSettings.from_env()
    return {
        "reconcile": entry("llmgw.reconcile", settings.reconcile_interval),
        "publish": entry("llmgw.publish", settings.publish_interval),
        "housekeeping": entry("llmgw.housekeeping", HOUSEKEEPING_INTERVAL),
        "external": entry("llmgw.external", settings.external_interval),
        # The Batch API: a run for every unfinished batch nobody feeds (docs/batch.md).
        "batch-sweep": entry(SWEEP_TASK, batch.sweep_interval, BATCH_QUEUE),
    }
