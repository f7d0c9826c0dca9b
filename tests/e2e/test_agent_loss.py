"""A node agent's death does not take healthy engines out of routing (issue 17).

The engines are the data plane: when an agent dies (crash, OOM kill, restart for an upgrade) its
node's heartbeat expires, but Ready replicas whose engines keep answering stay published until the
gateways see them fail or a grace passes. A real machine loss (agent and engines gone) still moves
traffic away: the gateways retry before the first byte and report the failures, and the publisher
drops the dead endpoints."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.clients import start_loops, stop_loops
from harness.cluster import FAST_AGENT, FAST_ENV, sim_catalog
from harness.procs import hold, wait_until

pytestmark = pytest.mark.slow

CATALOG = sim_catalog(replicas=2)
TTL = float(FAST_ENV["LLMGW_HEARTBEAT_TTL"])
EJECT_FOR = 5.0  # the gateway's default LLMGW_GATEWAY_EJECT_FOR


def routable(cluster) -> set[str]:
    return {e.id for e in cluster.store().read_endpoints().endpoints}


def test_agent_down_twenty_seconds_costs_no_request_and_no_restart(cluster):
    urls = cluster.start_system(CATALOG, node_env=FAST_AGENT, gateways=2, routed=2)
    wait_until(lambda: len(routable(cluster)) == 2, 60, what="two routable replicas")
    before = {r.id: (r.engine_pid, r.restarts, r.attempt) for r in cluster.store().all_replicas()}

    loops = [loop for url in urls for loop in start_loops(url, "chat", streaming=1, plain=1, max_tokens=4)]
    try:
        cluster.procs.get("node-a").kill9()
        store = cluster.store()
        wait_until(lambda: "a" not in store.live_nodes(), TTL + 5, interval=0.1, what="node a to be Lost")
        # The agent stays down well past the TTL while the clients keep going.
        def still_routed():
            assert routable(cluster) >= set(before), "a Lost node's serving replicas left routing"

        hold(17, still_routed)
        cluster.start_node("a", **FAST_AGENT)
        wait_until(lambda: all(r.adopted_at for r in cluster.store().all_replicas() if r.id in before), 30,
                   what="the engines to be re-adopted")
        # The replacements placed while a was gone (Pending: no other node) are gone again.
        wait_until(lambda: {r.id for r in cluster.store().all_replicas()} == set(before), 30,
                   what="the surplus Pending replacements to be dropped")
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    assert served > 20
    after = {r.id: (r.engine_pid, r.restarts, r.attempt) for r in cluster.store().all_replicas()}
    assert after == before  # same engines, never restarted


def test_a_real_machine_loss_moves_traffic_without_client_errors(cluster):
    [url] = cluster.start_system(CATALOG, nodes=("a", "b"), node_env=FAST_AGENT, routed=2)
    wait_until(lambda: len(routable(cluster)) == 2, 60, what="two routable replicas")
    on_a = [r for r in cluster.store().all_replicas() if r.node == "a"]
    assert len(on_a) == 1  # CPU replicas are spread

    loops = start_loops(url, "chat", streaming=0, plain=3, max_tokens=4)
    try:
        wait_until(lambda: sum(loop.ok for loop in loops) > 10, 20, what="traffic on both replicas")
        # The machine goes: its agent and its engines, at once.
        cluster.procs.get("node-a").kill9()
        for r in on_a:
            os.killpg(r.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: on_a[0].id not in routable(cluster), TTL + EJECT_FOR + 10, interval=0.1,
                   what="the dead endpoint to leave the published list")
        left_after = time.monotonic() - killed
        wait_until(lambda: sum(loop.ok for loop in loops) > 40, 30, what="traffic to go on")
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    print(f"dead endpoint unpublished {left_after:.2f}s after the machine loss (TTL {TTL}s, eject {EJECT_FOR}s); "
          f"{served} requests, 0 errors")
