"""Node-queue tasks: `llmgw.launch` and `llmgw.stop`.

Both are short and idempotent: they check that the record exists and is on this node, and push its id
on the agent's wake list so the loop acts at once. The control plane already recorded the intent (the
record, or its `stop_requested_at`) before sending them, and the loop converges on that record, so a
lost, duplicated or redelivered task does no harm.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import redis
from celery import shared_task
from celery.signals import worker_process_shutdown, worker_shutdown

from llmgw.store import Store, connect

log = logging.getLogger("llmgw.agent")


class StoreCache:
    """One Store (so one Redis connection pool) per Redis URL for this worker process, made on first
    use and closed at worker shutdown: a task must not build a client, and leak its sockets, per call.

    A prefork pool child gets its own: clients are never shared across a fork."""

    def __init__(self, connect: Callable[[str], redis.Redis] = connect):
        self._connect = connect
        self._lock = threading.Lock()
        self._stores: dict[str, Store] = {}
        self._pid = os.getpid()

    def get(self, url: str) -> Store:
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours to use
                self._stores, self._pid = {}, os.getpid()
            store = self._stores.get(url)
            if store is None:
                store = self._stores[url] = Store(self._connect(url))
            return store

    def close(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            try:
                store.r.close()
            except Exception:  # noqa: BLE001 - shutting down: nothing more to do about it
                log.debug("closing a Redis client failed", exc_info=True)


STORES = StoreCache()


@worker_shutdown.connect
@worker_process_shutdown.connect
def _close_stores(**_kw) -> None:
    STORES.close()


def _nudge(replica_id: str, what: str, stores: StoreCache = STORES) -> str:
    from celery import current_app

    settings = current_app.settings
    store = stores.get(settings.redis_url)
    rec = store.get_replica(replica_id)
    node = settings.node_name
    if rec is None:
        log.info("%s %s: no such replica record; nothing to do", what, replica_id)
        return "unknown"
    if node not in rec.all_nodes:
        log.warning("%s %s: the replica is placed on %s, not on %s; ignored", what, replica_id, rec.node, node)
        return "elsewhere"
    store.wake_agent(node, replica_id)
    return "woken"


@shared_task(name="llmgw.launch")
def launch(replica_id: str) -> str:
    return _nudge(replica_id, "launch")


@shared_task(name="llmgw.stop")
def stop(replica_id: str) -> str:
    return _nudge(replica_id, "stop")
