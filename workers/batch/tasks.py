"""The batch queue's tasks: thin shells. `llmgw.batch.run` feeds one batch for a slice
(`workers.batch.feed`); `llmgw.batch.sweep` (beat) sends a run for every unfinished batch that no run
holds or is on its way to, which is how a batch whose worker was killed is taken over.

A run holds its Celery thread for up to LLMGW_BATCH_SLICE seconds (plus the drain of its lines in
flight) and hands the batch back to the queue; it sends its lines from threads of its own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from celery import Task, shared_task

from llmgw.batch import kick
from llmgw.batch.config import BatchSettings
from llmgw.state.store import RedisError, Store
from workers.batch.client import LineSender
from workers.batch.feed import run_batch
from workers.store_cache import STORES

log = logging.getLogger("llmgw.batch")

CREDENTIAL_TTL = 2.0  # seconds a feeder trusts the batch workers' key it read


class BatchTask(Task):
    """What a worker process keeps between runs: its settings (read once) and the line sender."""

    _settings: BatchSettings | None = None
    _sender: LineSender | None = None
    _lock = threading.Lock()
    _credential: tuple[float, str | None] = (0.0, None)

    @property
    def settings(self) -> BatchSettings:
        if self._settings is None:
            type(self)._settings = BatchSettings.from_env()
        return self._settings  # type: ignore[return-value]

    def store(self) -> Store:
        return STORES.get(self.app.settings.redis_url)

    def credential(self) -> str | None:
        at, key = self._credential
        if time.monotonic() - at > CREDENTIAL_TTL:
            try:
                key = self.store().batch_credential()
            except RedisError:
                pass
            type(self)._credential = (time.monotonic(), key)
        return key

    @property
    def sender(self) -> LineSender:
        with self._lock:
            if self._sender is None:
                s = self.settings
                type(self)._sender = LineSender(s.gateway_url, s.request_timeout, self.credential)
        return self._sender  # type: ignore[return-value]

    def send_run(self, store: Store, batch_id: str) -> bool:
        return kick.send_run(store, kick.celery_run_sender(self.app), batch_id,
                             kick.queued_ttl(self.settings.slice_seconds))


@shared_task(name=kick.RUN_TASK, bind=True, base=BatchTask, ignore_result=True)
def run(self, batch_id: str) -> dict:
    store = self.store()
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    out = run_batch(store, self.settings, self.sender, batch_id, token, lambda bid: self.send_run(store, bid))
    log.info("batch %s: run %s (%d sent, %d recorded)", batch_id, out.result, out.sent, out.recorded)
    return {"batch": batch_id, "result": out.result, "sent": out.sent, "recorded": out.recorded}


@shared_task(name=kick.SWEEP_TASK, bind=True, base=BatchTask, ignore_result=True)
def sweep(self) -> dict:
    """Send a run for every unfinished batch nobody feeds (no lease) and none is on its way to."""
    store = self.store()
    ids = store.active_batch_ids()
    held = store.batch_leases(ids)
    sent = [i for i in ids if not held.get(i) and self.send_run(store, i)]
    if sent:
        log.info("batch sweep: sent runs for %s", ", ".join(sent))
    return {"active": len(ids), "sent": sent}
