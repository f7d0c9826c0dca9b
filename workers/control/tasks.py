"""Control-queue tasks: thin shells around `workers.control.apply` (load, decide, apply).

They share the worker process's one Redis client (workers/store_cache.py): beat runs them every
second or two, and the locks keep passes of the same kind from overlapping.
"""

from __future__ import annotations

import logging
import socket
import time

from celery import Task, shared_task

from llmgw.catalog import sync_from_file
from llmgw.state.store import Store
from workers.control.apply import CeleryDispatcher, housekeeping_once, publish_once, reconcile_once
from workers.control.snapshot import CatalogKeeper
from workers.store_cache import STORES

log = logging.getLogger("llmgw.control")


def _catalog_sync(store: Store, settings):
    """`llmgw.catalog.watch.sync_from_file` bound to this pass, or None when there is no file."""
    if settings.catalog_file is None:
        return None
    applied_by = f"control@{socket.gethostname()}"
    return lambda: sync_from_file(store, settings.catalog_file, applied_by)


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
    store = STORES.get(settings.redis_url)
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
    return publish_once(STORES.get(settings.redis_url), time.time,
                        lock_ttl=max(5.0, 5 * settings.publish_interval), catalogs=self.catalogs)


@shared_task(name="llmgw.housekeeping", bind=True)
def housekeeping(self) -> dict:
    return housekeeping_once(STORES.get(self.app.settings.redis_url), time.time())
