"""Two gateways on one Redis, one killed -9 and restarted under load (issue 15, fault 9).

The survivor's clients see no error, the restarted gateway serves again by itself, and together the
gateways never hold more than a replica's `capacity` in flight for longer than one scrape interval:
counted at the engine itself (running + waiting in its /metrics, read by the test every 50 ms), not by
what the gateways believe.

A gateway learns what the others send to a replica from the agent's scrape of the engine, which it
reads from Redis every LLMGW_GATEWAY_LOAD_INTERVAL; until then it counts only its own requests. So the
gateways can send more than `capacity` for one scrape interval plus that refresh, and what they sent
then stays at the engine until it is served: that is the bound checked, with the scrape intervals that
really happened (the LoadRecords' timestamps; on a busy machine a scrape comes late) and the slowest
request the clients saw. Without the shared scrape, 12 clients for 8 slots would keep the engines
above capacity the whole time.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import requests

from tests.faults.fleet import AGENT
from tests.support.clients import start_loops, stop_loops
from harness.cluster import sim_catalog
from harness.procs import hold, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow]

CAPACITY = 4
LOAD_REFRESH = 0.5  # LLMGW_GATEWAY_LOAD_INTERVAL (default): when a gateway reads the new scrape
SAMPLE = 0.1  # how coarsely this test sees the engines (50 ms apart, two engines, a busy machine)
METRIC = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\} (\S+)$", re.M)


class EngineCounter(threading.Thread):
    """Reads each engine's running + waiting every 50 ms; keeps every stretch above `capacity`, and the
    longest gap between two scrapes of the engines by their agents (LoadRecord timestamps)."""

    def __init__(self, urls: list[str], capacity: int, store=None, ids: list[str] = ()):
        super().__init__(daemon=True)
        self.urls, self.capacity, self.halt = urls, capacity, threading.Event()
        self.store, self.ids = store, list(ids)
        self.scraped: dict[str, float] = {}
        self.scrape_gap = 0.0
        self.samples = 0
        self.peak = {u: 0 for u in urls}
        self.over: dict[str, float | None] = {u: None for u in urls}  # since when above capacity
        self.episodes: list[tuple[str, float, int]] = []  # (engine, seconds above capacity, peak)
        self._peak_now = {u: 0 for u in urls}

    def run(self) -> None:
        sessions = {u: requests.Session() for u in self.urls}
        while not self.halt.wait(0.05):
            if self.store is not None:
                for rid, rec in self.store.loads(self.ids).items():
                    last = self.scraped.get(rid)
                    if last is not None and rec.ts != last:
                        self.scrape_gap = max(self.scrape_gap, rec.ts - last)
                    self.scraped[rid] = rec.ts
            for u in self.urls:
                try:
                    text = sessions[u].get(u + "/metrics", timeout=1).text
                except requests.RequestException:
                    continue
                n = int(sum(float(v) for _kind, v in METRIC.findall(text)))
                now = time.monotonic()
                self.samples += 1
                self.peak[u] = max(self.peak[u], n)
                if n > self.capacity:
                    if self.over[u] is None:
                        self.over[u], self._peak_now[u] = now, n
                    self._peak_now[u] = max(self._peak_now[u], n)
                elif self.over[u] is not None:
                    self.episodes.append((u, now - self.over[u], self._peak_now[u]))
                    self.over[u] = None

    def stop(self) -> None:
        self.halt.set()
        self.join(5)
        now = time.monotonic()
        for u, since in self.over.items():
            if since is not None:
                self.episodes.append((u, now - since, self._peak_now[u]))


def test_two_gateways_one_killed_and_restarted(cluster):
    survivor, victim = cluster.start_system(sim_catalog(replicas=2, capacity=CAPACITY), nodes=("a", "b"),
                                            node_env=AGENT, gateways=2, routed=2)
    victim_port = int(victim.rsplit(":", 1)[1])
    published = cluster.store().read_endpoints().endpoints
    counter = EngineCounter([e.url for e in published], CAPACITY, cluster.store(), [e.id for e in published])
    counter.start()
    # 12 clients for 8 slots: the gateways must share the engines' capacity through the scraped load.
    theirs = start_loops(survivor, "chat", streaming=3, plain=3, max_tokens=16)
    ours = start_loops(victim, "chat", streaming=3, plain=3, max_tokens=16)
    try:
        wait_until(lambda: min(loop.ok for loop in theirs + ours) > 3, 30, what="traffic through both gateways")

        def survivor_clean():
            errors = [e for loop in theirs for e in loop.errors]
            assert not errors, f"the survivor's clients saw errors: {errors[:3]}"

        hold(3, survivor_clean)
        cluster.procs.get("gateway2").signal_group(9)  # master and worker, in flight or not
        hold(5, survivor_clean)
        served_before = sum(loop.ok for loop in ours)
        cluster.start_gateway(port=victim_port, name="gateway2")
        wait_until(lambda: sum(loop.ok for loop in ours) > served_before + 20, 30,
                   what="the restarted gateway to serve its clients again")
        hold(5, survivor_clean)
    finally:
        served, errors = stop_loops(theirs)
        victim_served, victim_errors = stop_loops(ours)
        counter.stop()
    assert not errors, errors[:5]
    worst = max((d for _u, d, _p in counter.episodes), default=0.0)
    print(f"two gateways, one killed -9 and restarted: survivor {served} requests 0 errors; the victim's clients "
          f"{victim_served} served, {len(victim_errors)} failed while it was down; engine in-flight peaks "
          f"{sorted(counter.peak.values())} for capacity {CAPACITY}, {len(counter.episodes)} stretches above it, "
          f"longest {worst:.2f}s; longest scrape interval {counter.scrape_gap:.2f}s, slowest request "
          f"{max(loop.longest for loop in theirs):.2f}s ({counter.samples} samples)")
    assert counter.samples > 100 and counter.scrape_gap > 0
    service = max(loop.longest for loop in theirs)
    assert worst <= counter.scrape_gap + LOAD_REFRESH + service + SAMPLE, (service, counter.episodes)
