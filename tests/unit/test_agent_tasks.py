"""The node-queue tasks reuse one Redis client per worker process and close it at worker shutdown."""

from __future__ import annotations

import fakeredis
import pytest
from celery.signals import worker_process_shutdown, worker_shutdown

from llmgw.settings import ControlSettings
from llmgw.state.records import ReplicaRecord
from workers import store_cache
from workers.agent import tasks
from workers.store_cache import STORES, StoreCache


class Clients:
    def __init__(self):
        self.made: list[str] = []
        self.closed = 0
        self.server = fakeredis.FakeServer()

    def connect(self, url):
        self.made.append(url)
        r = fakeredis.FakeRedis(server=self.server, decode_responses=True)
        real_close = r.close

        def close():
            self.closed += 1
            real_close()

        r.close = close
        return r


@pytest.fixture
def app(monkeypatch):
    from workers.celery_app import create_celery_app

    app = create_celery_app(ControlSettings(node_name="a", redis_url="redis://127.0.0.1:1/0"))
    app.set_current()
    return app


def test_one_client_per_url_reused_across_tasks_and_closed_at_shutdown(app, monkeypatch):
    clients = Clients()
    stores = StoreCache(clients.connect)
    monkeypatch.setattr(store_cache, "STORES", stores)  # what the shutdown signals close
    store = stores.get(app.settings.redis_url)
    store.create_replica(ReplicaRecord(id="r1", model="m", profile="p", node="a", nodes=["a"]))
    store.create_replica(ReplicaRecord(id="r2", model="m", profile="p", node="b", nodes=["b", "a"]))
    results = [tasks._nudge(rid, "launch", stores) for rid in ("r1", "r2", "r1", "gone")]
    assert results == ["woken", "woken", "woken", "unknown"]  # r2: a member part on this node
    assert clients.made == [app.settings.redis_url], "a new Redis client per task"
    assert store.r.lrange("llmgw:node:a:wake", 0, -1) == ["r1", "r2", "r1"]
    worker_process_shutdown.send(sender=None)  # what a prefork child sends as it exits
    assert clients.closed == 1
    stores.get(app.settings.redis_url)
    worker_shutdown.send(sender=None)
    assert clients.closed == 2 and len(clients.made) == 2


def test_the_shutdown_signals_close_the_module_cache(monkeypatch):
    closed = []
    monkeypatch.setattr(STORES, "close", lambda: closed.append(1))
    worker_shutdown.send(sender=None)
    worker_process_shutdown.send(sender=None)
    assert closed == [1, 1]
