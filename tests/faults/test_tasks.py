"""Launch and stop tasks delivered twice, or again after their agent died (issue 15, fault 4).

What the design does: `llmgw.launch` / `llmgw.stop` only wake the node agent, whose loop converges on
the replica records every tick (level-based); the tasks do not use `acks_late` (workers/celery_app.py:
`task_acks_late=False`). A task taken by an agent that dies before running it is therefore lost, not
redelivered, and nothing depends on it: the agent's next tick converges anyway, and the control plane
re-sends a launch still unstarted after 5 s and a stop unconfirmed after 10 s. A message delivered
again (kombu's Redis transport pushes an unacknowledged message's payload back onto its queue after
the visibility timeout) is what this test replays by hand, byte for byte.
"""

from __future__ import annotations

import os
import uuid

import pytest

from llmgw.state.keys import node_queue
from llmgw.state.kicks import broker_app
from tests.faults.fleet import (
    AGENT,
    catalog,
    current,
    engines,
    expected,
    identities,
    settle,
    start_fleet,
)
from tests.support.clients import start_loops, stop_loops
from harness.procs import TOKEN_VAR, hold, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SLOW_TTL = {"LLMGW_HEARTBEAT_TTL": "60"}


def test_launch_and_stop_delivered_twice_or_after_the_agent_died(cluster):
    token = os.environ[TOKEN_VAR]
    # A long heartbeat TTL: the dead agent's node stays live to the control plane, which keeps
    # placing on it and re-sending the launch into its queue (as during an agent restart).
    [url] = start_fleet(cluster, nodes=("a",), gpus="h100:4", node_env=SLOW_TTL)
    store, r = cluster.store(), cluster.redis()
    app = broker_app(cluster.redis_url)
    queue = node_queue("a")
    loops = start_loops(url, "chat", streaming=2, plain=2)

    def unchanged(before):
        def check():
            errors = [e for loop in loops for e in loop.errors]
            assert not errors, f"clients saw errors: {errors[:3]}"
            now = identities(store)
            assert {rid: now.get(rid) for rid in before} == before, "an engine was started again"
            per = [rid for rid in engines(token).values()]
            assert len(per) == len(set(per)), f"a replica runs two engines: {per}"
        return check

    try:
        # Every replica's launch and stop, each twice under one task id, and ten more times.
        before = identities(store)
        for rec in current(store):
            for task in ("llmgw.launch", "llmgw.stop"):
                tid = str(uuid.uuid4())
                for _ in range(2):
                    app.send_task(task, args=[rec.id], queue=queue, task_id=tid)
                for _ in range(10):
                    app.send_task(task, args=[rec.id], queue=queue)
        wait_until(lambda: r.llen(queue) == 0, 20, what="the agent to take every task")
        hold(3, unchanged(before))

        # The agent dies; launches for a new replica wait in its queue (and are re-sent meanwhile).
        cluster.procs.get("node-a").kill9()
        cluster.apply_catalog(catalog(gpu=3), name="gpu3.yaml")
        new = wait_until(lambda: [x for x in current(store) if x.id not in before], 20, what="the new record")[0]
        wait_until(lambda: r.llen(queue) >= 2, 20, what="the launch and its re-dispatch to be queued")
        queued = r.lrange(queue, 0, -1)
        app.send_task("llmgw.launch", args=[new.id], queue=queue)
        cluster.start_node("a", gpus="h100:4", **AGENT, **SLOW_TTL)
        settle(cluster, expected(gpu=3), timeout=60)
        assert store.get_replica(new.id).attempt == 1
        after = identities(store)
        assert {rid: after[rid] for rid in before} == before, "the restarted agent restarted an engine"
        # The same messages delivered again, byte for byte (as kombu restores an unacknowledged one).
        r.rpush(queue, *queued)
        wait_until(lambda: r.llen(queue) == 0, 20, what="the agent to take the redelivered tasks")
        hold(3, unchanged(identities(store)))

        # A stop delivered many times: one drain, one SIGTERM, the record gone, no engine left.
        cluster.apply_catalog(catalog(gpu=2), name="gpu2.yaml")
        stopping = wait_until(lambda: [x for x in store.all_replicas() if x.stop_requested_at], 20,
                              what="a stop to be requested")[0]
        for _ in range(10):
            app.send_task("llmgw.stop", args=[stopping.id], queue=queue)
        settle(cluster, expected(gpu=2), timeout=60)
        assert stopping.id not in engines(token).values()
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    print(f"launch/stop tasks duplicated and redelivered: {served} requests, 0 errors, one engine per replica")
