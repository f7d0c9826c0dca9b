"""Control-queue tasks: thin shells around each pass's shell (`apply.reconcile_once`,
`publish_pass.publish_once`, `housekeeping_pass.housekeeping_once`, `external.external_once`).

They share the worker process's one Redis client (workers/store_cache.py): beat runs them every
second or two, and the locks keep passes of the same kind from overlapping.
"""

from __future__ import annotations

import logging
import socket
import time

from celery import Task, shared_task

from llmgw import tracing
from llmgw.catalog import sync_from_file
from llmgw.state.kicks import Kicker, celery_sender
from llmgw.state.store import Store
from workers.control.apply import CeleryDispatcher, reconcile_once
from workers.agent.probe import HttpProber
from workers.control.external import ExternalConfig, external_once
from workers.control.housekeeping_pass import housekeeping_once
from workers.control.publish_pass import PublishMemory, publish_once
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
    _memory: PublishMemory | None = None

    @property
    def catalogs(self) -> CatalogKeeper:
        if self._catalogs is None:
            self._catalogs = CatalogKeeper()
        return self._catalogs

    @property
    def memory(self) -> PublishMemory:
        if self._memory is None:
            self._memory = PublishMemory()
        return self._memory

    def kicker(self, store: Store) -> Kicker:
        return Kicker(store, celery_sender(self.app), enabled=self.app.settings.event_driven)


def _tracing():
    """The worker process's tracing, set up on its first pass (in the process that runs the tasks)."""
    return tracing.configure("llmgw-control")


@shared_task(name="llmgw.reconcile", bind=True, base=ControlTask)
def reconcile(self) -> dict | None:
    settings = self.app.settings
    store = STORES.get(settings.redis_url, settings.durability)  # the catalog file's applies wait for replicas
    # A kicked pass is the child of what kicked it (a catalog apply: the task's headers); a timer's
    # pass starts a trace of its own. The records it creates carry the pass to their launches.
    with _tracing().span("llmgw.reconcile", parent=tracing.from_task(self.request), kind="consumer") as span:
        result = reconcile_once(
            store,
            CeleryDispatcher(self.app),
            time.time,
            lock_ttl=max(10.0, 5 * settings.reconcile_interval),
            catalog_sync=_catalog_sync(store, settings),
            catalogs=self.catalogs,
            kicker=self.kicker(store),
            trace=span.traceparent,
        )
        span.set("llmgw.pass.ran", result is not None)
        if result is not None:
            span.set("llmgw.pass.applied", result.applied)
            span.set("llmgw.pass.failed", result.failed)
            span.set("llmgw.pass.deferred", result.deferred)
    return None if result is None else {"applied": result.applied, "failed": result.failed}


@shared_task(name="llmgw.publish", bind=True, base=ControlTask)
def publish(self) -> int | None:
    settings = self.app.settings
    store = STORES.get(settings.redis_url, settings.durability)
    with _tracing().span("llmgw.publish", parent=tracing.from_task(self.request), kind="consumer") as span:
        version = publish_once(store, time.time, lock_ttl=max(5.0, 5 * settings.publish_interval),
                               catalogs=self.catalogs, kicker=self.kicker(store), memory=self.memory)
        span.set("llmgw.publish.version", version)  # only when the list changed
    return version


@shared_task(name="llmgw.housekeeping", bind=True)
def housekeeping(self) -> dict:
    return housekeeping_once(STORES.get(self.app.settings.redis_url, self.app.settings.durability), time.time())


@shared_task(name="llmgw.external", bind=True, base=ControlTask)
def external(self) -> dict | None:
    settings = self.app.settings
    config = ExternalConfig(settings.external_check_interval, settings.external_timeout, settings.external_failures)
    store = STORES.get(settings.redis_url, settings.durability)
    return external_once(store, HttpProber(), time.time, config, lock_ttl=max(10.0, 4 * settings.external_timeout),
                         catalogs=self.catalogs, kicker=self.kicker(store),
                         load_ttl=max(10.0, 10 * settings.external_interval))
