"""One Redis client per worker process, shared by its tasks (control and node queues alike).

A task must not build a client, and a connection pool, per call: beat sends the control tasks every
second. Closed at worker shutdown; a prefork pool child builds its own after the fork.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from celery.signals import worker_process_shutdown, worker_shutdown

from llmgw.state.store import Durability, Store, connect

log = logging.getLogger("llmgw.workers")


class StoreCache:
    """One Store (so one Redis connection pool) per Redis URL (and durability) for this worker process,
    made on first use and closed at worker shutdown: a task must not build a client, and leak its
    sockets, per call.

    A prefork pool child gets its own: clients are never shared across a fork."""

    def __init__(self, connect: Callable[[str], Any] = connect):
        self._connect = connect
        self._lock = threading.Lock()
        self._stores: dict[tuple[str, Durability], Store] = {}
        self._pid = os.getpid()

    def get(self, url: str, durability: Durability | None = None) -> Store:
        """`durability`: what the store's must-not-lose writes wait for (`Settings.durability`)."""
        key = (url, durability or Durability())
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours to use
                self._stores, self._pid = {}, os.getpid()
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = Store(self._connect(url), key[1])
            return store

    def close(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - shutting down: nothing more to do about it
                log.debug("closing a Redis client failed", exc_info=True)


STORES = StoreCache()


@worker_shutdown.connect
@worker_process_shutdown.connect
def _close_stores(**_kw) -> None:
    STORES.close()
