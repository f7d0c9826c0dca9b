"""A gateway process's router and the pollers that feed it, made as gateway.app makes them (tests call
the pollers' refreshes directly instead of running their loops)."""

from __future__ import annotations

import random

from gateway.config import GatewaySettings
from gateway.routing.inflight import InFlight
from gateway.routing.router import Router
from gateway.server.pollers import Pollers
from llmgw.state.clock import Clock


def polled(store, cfg: GatewaySettings, clock: Clock, shared=None) -> tuple[Router, Pollers]:
    """`shared`: the sibling workers' table (gateway.server.siblings), None alone."""
    router = Router(cfg.routing, clock, random.Random(cfg.seed), InFlight(shared))
    return router, Pollers(store, cfg, router)
