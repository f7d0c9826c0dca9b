"""Facts drive the control passes; beat's timers are the backstop (issue 18).

With beat's intervals set to a minute, a catalog apply still converges and a killed engine's endpoint
still leaves the list at once: only kicks can have done it. With kicks switched off
(LLMGW_EVENT_DRIVEN=0) and short timers, the timers alone still converge."""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness.cluster import sim_catalog
from harness.procs import wait_until

pytestmark = pytest.mark.slow

CATALOG = sim_catalog(replicas=2)
LONG = {"LLMGW_RECONCILE_INTERVAL": "60", "LLMGW_PUBLISH_INTERVAL": "60"}
AGENT = {"LLMGW_AGENT_TICK": "0.2"}


def published(cluster) -> set[str]:
    return {e.id for e in cluster.store().read_endpoints().endpoints}


def start(cluster, **env):
    cluster.start_system(node_env={**AGENT, **env}, control_env=env, gateways=0)
    return cluster.store()


def test_with_minute_long_timers_kicks_converge_and_unpublish(cluster):
    store = start(cluster, **LONG)
    t0 = time.monotonic()
    cluster.apply_catalog(CATALOG)  # the CLI kicks a reconcile
    # Deadlines well below the 60 s timers: only kicks can converge in time.
    wait_until(lambda: len(published(cluster)) == 2, 30, interval=0.05, what="two replicas published")
    converged = time.monotonic() - t0
    victim = next(r for r in store.all_replicas())
    t1 = time.monotonic()
    os.kill(victim.engine_pid, signal.SIGKILL)
    wait_until(lambda: victim.id not in published(cluster), 20, interval=0.05, what="the killed engine unpublished")
    print(f"apply -> 2 published in {converged:.2f}s, kill -> unpublished in {time.monotonic() - t1:.2f}s "
          "with 60 s timers")
    # ... and it comes back (Ready kicks a publish) without waiting for a timer.
    wait_until(lambda: victim.id in published(cluster), 30, interval=0.05, what="the restarted engine republished")


def test_with_kicks_off_the_timers_alone_converge(cluster):
    store = start(cluster, LLMGW_EVENT_DRIVEN="0")
    cluster.apply_catalog(CATALOG)
    wait_until(lambda: len(published(cluster)) == 2, 60, what="two replicas published by the timers")
    victim = next(r for r in store.all_replicas())
    os.kill(victim.engine_pid, signal.SIGKILL)
    wait_until(lambda: victim.id not in published(cluster), 30, what="the killed engine unpublished by the timers")
