"""Sending a batch's run task: the gateway does when a batch is created or cancelled, a run task when
it hands a batch back, the sweep for every unfinished batch nobody feeds. A mark in Redis says one is
on its way, so a batch waiting in the queue is not sent again and again (a lost task's mark expires,
then the sweep sends another)."""

from __future__ import annotations

import logging
from typing import Callable

from llmgw.state.keys import BATCH_QUEUE
from llmgw.state.store import RedisError, Store

log = logging.getLogger("llmgw.batch")

RUN_TASK = "llmgw.batch.run"
SWEEP_TASK = "llmgw.batch.sweep"

Sender = Callable[[str], None]  # batch id -> sends its run task


def celery_run_sender(app) -> Sender:
    """Send `llmgw.batch.run` by name on the batch queue through a Celery app (a worker's own, or
    `llmgw.state.kicks.broker_app` in the gateway)."""

    def send(batch_id: str) -> None:
        app.send_task(RUN_TASK, args=[batch_id], queue=BATCH_QUEUE)

    return send


def send_run(store: Store, send: Sender, batch_id: str, queued_ttl: float) -> bool:
    """Send the batch's run task unless one is on its way. Never raises: the sweep repairs a send
    that failed. True if one was sent."""
    try:
        if not store.mark_batch_queued(batch_id, queued_ttl):
            return False
        send(batch_id)
        return True
    except (RedisError, OSError, Exception) as e:  # noqa: BLE001 - kombu's errors are many; the sweep repairs
        log.warning("could not send the run task of %s (%s); the sweep will", batch_id, e)
        try:
            store.clear_batch_queued(batch_id)
        except RedisError:
            pass
        return False


def queued_ttl(slice_seconds: float) -> float:
    """How long a sent run task counts as on its way: a slice of another batch ahead of it, and a margin."""
    return slice_seconds + 30.0
