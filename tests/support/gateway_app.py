"""One gateway app on fakeredis for the gateway's tests: the fixtures (`server`, `store`: import them
into a test module by name), endpoints, clocks, and apps loaded (`make_app`) or not yet (`bare_app`)."""

from __future__ import annotations

import socket
import time

import fakeredis
import pytest

from gateway.app import create_app
from gateway.config import GatewaySettings, RoutingConfig
from llmgw.state.records import EndpointInfo
from llmgw.state.store import Store
from tests.support.clock import FakeClock

CHAT = "/v1/chat/completions"
# LoadRecords injected by a test must not go stale (3 s by default) while a slow machine runs it.
NEVER_STALE = RoutingConfig(stale_after=3600)


@pytest.fixture
def server():
    return fakeredis.FakeServer()


@pytest.fixture
def store(server):
    return Store(fakeredis.FakeRedis(server=server, decode_responses=True))


def endpoint(i, url, models=("m", "m-alias"), **kw):
    return EndpointInfo(id=i, url=url, models=models, engine="sim", served_name=f"served-{models[0]}",
                        model=models[0], **{"capacity": 4, **kw})


def wall_clock() -> FakeClock:
    """Rate-limit windows are wall-clock minutes (a real minute could turn mid-test), while queue
    timeouts need time to pass: the wall clock stands 20 s into a minute, monotonic time is real."""
    return FakeClock(2_000_000_000.0, real_monotonic=True)


def make_app(store, eps, clock=None, tracing=None, **cfg):
    routing = cfg.pop("routing", RoutingConfig())
    store.write_endpoints(eps, "fp", time.time())
    app = create_app(GatewaySettings(routing=routing, **cfg), store=store, clock=clock, tracing=tracing)
    app.extensions["llmgw"].refresh()
    return app, app.extensions["llmgw"], app.test_client()


def bare_app(store, eps, **cfg):
    """An app whose background state has not been loaded yet (as at start-up)."""
    store.write_endpoints(eps, "fp", time.time())
    app = create_app(GatewaySettings(**cfg), store=store)
    return app, app.extensions["llmgw"], app.test_client()


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


def metric(text: str, sample: str) -> float:
    """The value of one exact sample (`name{labels}`) in a Prometheus text page; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0
