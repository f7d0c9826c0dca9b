"""The fleet as the control plane records it, read from Redis for the console and the fleet metrics.

One read (the applied catalog, `llmgw status`'s report, the gateway reports) serves every request of
the process for FLEET_CACHE seconds: several open consoles and a Prometheus scrape cost one read.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from llmgw.catalog import Catalog, read_applied
from llmgw.cli.status import gather_status
from llmgw.state.clock import Clock
from llmgw.state.demand_records import GatewayReport
from llmgw.state.store import Store

FLEET_CACHE = 1.0  # seconds


@dataclass(frozen=True)
class Fleet:
    catalog: Catalog | None
    report: dict  # llmgw.cli.status.build_status
    gateways: list[GatewayReport]
    control: dict[str, float]  # Store.control_stats: the control passes' counters
    now: float


class FleetView:
    def __init__(self, store: Store, clock: Clock, ttl: float = FLEET_CACHE):
        self.store, self.clock, self.ttl = store, clock, ttl
        self.lock = threading.Lock()
        self.at, self.value = float("-inf"), None

    def get(self) -> Fleet:
        with self.lock:
            if self.value is None or self.clock.monotonic() - self.at >= self.ttl:
                self.value, self.at = self.read(), self.clock.monotonic()
            return self.value

    def read(self) -> Fleet:
        now = self.clock.time()
        _version, catalog, _meta = read_applied(self.store)
        return Fleet(catalog, gather_status(self.store, now), self.store.gateway_reports(),
                     self.store.control_stats(), now)
