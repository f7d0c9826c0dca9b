"""Control-queue tasks: thin shells around `workers.control.apply` (load, decide, apply).

Each opens its own Redis connection for the pass (a millisecond on the broker's network) and closes
it, so no client outlives a task; beat runs them every few seconds and the locks keep passes of the
same kind from overlapping.
"""

from __future__ import annotations

import logging
import socket
import time
from contextlib import contextmanager
from typing import Iterator

from celery import Task, shared_task

from llmgw.store import Store, connect
from workers.control.apply import CeleryDispatcher, housekeeping_once, publish_once, reconcile_once
from workers.control.snapshot import CatalogKeeper

log = logging.getLogger("llmgw.control")


@contextmanager
def _store(settings) -> Iterator[Store]:
    r = connect(settings.redis_url)
    try:
        yield Store(r)
    finally:
        r.close()


def _catalog_sync(store: Store, settings):
    """`llmgw.catalog_watch.sync_from_file` bound to this pass, or None when there is no file (or the
    module is not installed in this build)."""
    if settings.catalog_file is None:
        return None
    try:
        from llmgw.catalog_watch import sync_from_file
    except ImportError:
        log.warning("LLMGW_CATALOG is set but llmgw.catalog_watch is unavailable; file not watched")
        return None
    applied_by = f"control@{socket.gethostname()}"
    return lambda: sync_from_file(store.r, settings.catalog_file, applied_by)


class ControlTask(Task):
    """Celery instantiates a task class once per worker process: the place for what a process keeps
    between passes (the last good catalog, so an unreadable one never stops the fleet)."""

    _catalogs: CatalogKeeper | None = None

    @property
    def catalogs(self) -> CatalogKeeper:
        if self._catalogs is None:
            self._catalogs = CatalogKeeper()
        return self._catalogs


@shared_task(name="llmgw.reconcile", bind=True, base=ControlTask)
def reconcile(self) -> dict | None:
    settings = self.app.settings
    with _store(settings) as store:
        result = reconcile_once(
            store,
            CeleryDispatcher(self.app),
            time.time,
            lock_ttl=max(10.0, 5 * settings.reconcile_interval),
            catalog_sync=_catalog_sync(store, settings),
            catalogs=self.catalogs,
        )
    return None if result is None else {"applied": result.applied, "failed": result.failed}


@shared_task(name="llmgw.publish", bind=True, base=ControlTask)
def publish(self) -> int | None:
    settings = self.app.settings
    with _store(settings) as store:
        return publish_once(store, time.time, lock_ttl=max(5.0, 5 * settings.publish_interval),
                            catalogs=self.catalogs)


@shared_task(name="llmgw.housekeeping", bind=True)
def housekeeping(self) -> dict:
    with _store(self.app.settings) as store:
        return housekeeping_once(store, time.time())
