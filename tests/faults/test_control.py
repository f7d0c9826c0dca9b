"""The control plane's own processes fail, or run twice, under load (issue 15, faults 1-3).

1. The control worker is killed (-9) for 20 s while the catalog changes: serving is unaffected, and
   once it is back it converges with no duplicate replica, no GPU held twice and no orphan engine.
2. Beat is killed for 20 s: the catalog change it misses converges anyway (facts kick the passes);
   then two beats run at once (a common deployment mistake): every action is taken exactly once.
3. Two control workers with 4 threads each, and a reconcile pass frozen in the middle (SIGSTOP) past
   its lock's TTL while the other worker's passes run, then thawed: still exactly the catalog's
   replica count, every GPU held once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest
import redis as redis_lib

from llmgw.catalog import apply_catalog, parse_catalog_text
from llmgw.state import keys as K
from llmgw.state.node_records import GPUDevice, NodeInfo
from tests.faults.fleet import (
    AGENT,
    catalog,
    current,
    expected,
    gpu_conflicts,
    identities,
    orphans,
    settle,
    start_fleet,
    states,
)
from tests.support.clients import start_loops, stop_loops
from harness.procs import TOKEN_VAR, hold, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow]

OUTAGE = 20.0


def no_client_errors(loops):
    def check():
        errors = [e for loop in loops for e in loop.errors]
        assert not errors, f"clients saw errors: {errors[:3]}"
    return check


def test_control_worker_then_beat_killed_for_twenty_seconds_and_two_beats(cluster):
    [url] = start_fleet(cluster)
    store = cluster.store()
    first = identities(store)
    loops = start_loops(url, "chat-latest", streaming=2, plain=2)
    try:
        wait_until(lambda: sum(loop.ok for loop in loops) > 10, 30, what="traffic")

        # 1. The control worker dies; the catalog changes while it is away.
        cluster.procs.get("control").kill9()
        cluster.apply_catalog(catalog(gpu=3), name="gpu3.yaml")
        hold(OUTAGE, no_client_errors(loops))
        assert {r.id for r in current(store)} == set(first), "something placed replicas without a control worker"
        cluster.start_control()
        settle(cluster, expected(gpu=3), timeout=60)
        after = identities(store)
        assert {rid: after[rid] for rid in first} == first, "a running engine was restarted"

        # 2. Beat dies; a change converges from its kicks alone, within the outage.
        cluster.procs.get("beat").kill9()
        died = time.monotonic()
        cluster.apply_catalog(catalog(gpu=4), name="gpu4.yaml")
        settle(cluster, expected(gpu=4), timeout=OUTAGE)
        hold(OUTAGE - (time.monotonic() - died), no_client_errors(loops))
        cluster.start_beat()
        # ... and then two beats at once: each tick sends every task twice, each action happens once.
        cluster.start_beat(name="beat2")
        wait_until(lambda: "beat: Starting..." in cluster.procs.get("beat2").log(50), 20, what="the second beat")
        mark = store.latest_events(1)[-1].id
        passes = store.control_stats().get("reconcile:passes", 0)
        cluster.apply_catalog(catalog(gpu=2, cpu=2), name="gpu2-cpu2.yaml")
        settle(cluster, expected(gpu=2, cpu=2), timeout=60)
        hold(5, no_client_errors(loops))  # doubled ticks after it converged
        # ... at least five passes of them (a loaded machine may run fewer in the 5 s), then the count.
        wait_until(lambda: store.control_stats()["reconcile:passes"] - passes >= 5, 30, what="5 reconcile passes")
        kinds = Counter(e.kind for e in store.read_events(after=mark))
        assert (kinds["replica_placed"], kinds["replica_draining"], kinds["replica_stopped"]) == (1, 2, 2), kinds
        cluster.procs.get("beat2").stop()
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    print(f"control worker and beat down {OUTAGE:.0f}s each, two beats: {served} requests, 0 errors")


# --- 3. overlapping reconcile passes ----------------------------------------------------------------
GHOSTS, GPUS_EACH = 40, 4
BULK = """
models:
  - name: chat
    profiles:
      - {{name: cpu, engine: sim, replicas: 1}}
  - name: bulk
    profiles:
      - {{name: gpu, engine: sim, replicas: {n}, gpu: {{class: h100, count: 1}}}}
"""


class Ghosts(threading.Thread):
    """Heartbeats of GPU nodes without an agent: placement fills them, nothing runs there (the launch
    tasks wait in their queues), so a pass that places many replicas takes a while."""

    def __init__(self, store):
        super().__init__(daemon=True)
        self.store, self.halt = store, threading.Event()

    def beat(self) -> None:
        gpus = tuple(GPUDevice(i, "h100") for i in range(GPUS_EACH))
        for n in range(GHOSTS):
            self.store.write_heartbeat(NodeInfo(f"ghost-{n:02d}", gpus=gpus, heartbeat_at=time.time()), ttl=5)

    def run(self) -> None:
        while not self.halt.wait(0.5):
            try:
                self.beat()
            except redis_lib.RedisError:
                pass


def bulk_records(store) -> list:
    return [r for r in store.all_replicas() if r.model == "bulk"]


def test_a_reconcile_pass_frozen_past_its_lock_and_thawed_duplicates_nothing(cluster):
    token = os.environ[TOKEN_VAR]
    cluster.start_redis()
    store = cluster.store()
    ghosts = Ghosts(store)
    ghosts.beat()
    ghosts.start()
    try:
        [url] = cluster.start_system(BULK.format(n=0), node_env=AGENT)  # on the Redis just started
        a = cluster.procs.get("control")  # 4 threads
        wait_until(lambda: requests_ok(url), 60, what="chat to be served")
        loops = start_loops(url, "chat", streaming=1, plain=1)
        try:
            want = GHOSTS * GPUS_EACH  # every GPU of the fleet
            # Applied from here (the CLI could still be exiting when the pass is over); beat's next
            # tick runs the pass.
            apply_catalog(store, parse_catalog_text(BULK.format(n=want)), source="test", applied_by="test")
            # Freeze worker A in the middle of the pass that places them (it holds the lock).
            wait_until(lambda: 0 < len(store.r.smembers(K.REPLICAS)) - 1 < want // 2, 30, interval=0.001,
                       what="the placing pass to be under way")
            os.kill(a.pid, signal.SIGSTOP)
            frozen = len(bulk_records(store))
            b = cluster.start_control(name="control2", concurrency=4)
            # The lock expires (its TTL); B's passes take over and place the rest.
            wait_until(lambda: len(bulk_records(store)) >= want, 60, interval=0.1, what="B to place the rest")
            os.kill(a.pid, signal.SIGCONT)  # A wakes up in the middle of its stale pass
            wait_until(lambda: "deferred" in a.log(200) or "apply budget spent" in a.log(200), 30,
                       what="A to notice its pass ran out of time")
            hold(3, no_client_errors(loops))  # passes of both workers after the thaw

            recs = store.all_replicas()
            placed = Counter((r.model, r.profile) for r in recs if r.stop_requested_at is None)
            assert placed == {("bulk", "gpu"): want, ("chat", "cpu"): 1}, placed
            assert not [r.id for r in recs if r.stop_requested_at is not None], "a surplus replica was placed"
            assert not gpu_conflicts(recs, states(store))
            assert not orphans(store, token)
            assert a.alive() and b.alive()
        finally:
            served, errors = stop_loops(loops)
        assert not errors, errors[:5]
        print(f"pass frozen after placing {frozen} of {want}; after the thaw {want} placed, every GPU once; "
              f"{served} requests, 0 errors")
    finally:
        ghosts.halt.set()
        ghosts.join(5)


def requests_ok(url: str) -> bool:
    import requests

    return requests.post(url + "/v1/chat/completions", timeout=10, json={
        "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).ok
