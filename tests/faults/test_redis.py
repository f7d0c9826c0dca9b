"""Redis fails under load (issue 15, faults 5-7).

5+6. Redis is killed (-9) for 20 s and started again on its append-only file, as `llmgw up`, the
     Procfile and compose run it: the gateways serve from their cached tables with 0 errors, the agents
     keep their engines, the control plane resumes by itself, and the catalog, its history, the replica
     records, the keys and the usage survive (at most the last second of usage counts may be lost).
7.   Redis comes back without its data (a lost volume): the engines keep serving, the gateway keeps its
     last list, the control plane starts no second set of engines, the agents register their running
     engines again, and status and logs tell the operator to re-apply the catalog. Once they do, the
     same engines are routed again: nothing restarted.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import requests

from llmgw.catalog import read_applied
from llmgw.state import keys as K
from tests.faults.fleet import catalog, engines, expected, identities, settle, start_fleet
from tests.support.clients import start_loops, stop_loops
from harness.procs import TOKEN_VAR, hold, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow]

OUTAGE = 20.0  # seconds
FLUSH = 0.5  # the gateway's LLMGW_GATEWAY_USAGE_FLUSH default
FSYNC = 1.0  # appendfsync everysec


def health(url: str) -> dict:
    return requests.get(url + "/healthz", timeout=2).json()


def usage_requests(cluster, key_id: str) -> int:
    h = cluster.redis().hgetall(K.usage(key_id))
    return sum(int(v) for k, v in h.items() if k.endswith(":requests"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_redis_killed_for_twenty_seconds_loses_nothing(cluster):
    token = os.environ[TOKEN_VAR]
    [url] = start_fleet(cluster, redis={"persistent": True})
    key = cluster.llmgw("keys", "create", "team").stdout.strip()
    key_id = json.loads(cluster.llmgw("keys", "list", "--json").stdout)[0]["id"]
    auth = {"Authorization": f"Bearer {key}"}
    # Every gateway has loaded the key table (keys are then required).
    wait_until(lambda: requests.post(url + "/v1/chat/completions", json={"model": "chat"}, timeout=5).status_code
               == 401, 20, what="the gateway to require the new key")
    store = cluster.store()
    before = {"catalog": read_applied(store).version, "history": store.catalog_history(50), "records": identities(store),
              "keys": store.api_key_table()}
    procs = [p for p in cluster.procs.procs if p.name != "redis"]

    loops = start_loops(url, "chat", streaming=2, plain=2, headers=auth)
    try:
        wait_until(lambda: sum(loop.ok for loop in loops) > 20, 30, what="traffic before the outage")
        cluster.kill_redis()
        killed_at = time.time()
        wait_until(lambda: health(url)["redis"] == "unavailable", 10, what="the gateway to see the outage")

        def serving():
            errors = [e for loop in loops for e in loop.errors]
            assert not errors, f"clients saw errors during the outage: {errors[:3]}"
            gone = [f"{rid} (pid {pid})" for rid, (pid, _a, _r) in before["records"].items() if not alive(pid)]
            assert not gone, f"engines died during the outage: {gone}"

        served_at_kill = sum(loop.ok for loop in loops)
        hold(OUTAGE, serving)
        assert sum(loop.ok for loop in loops) > served_at_kill + 20, "the gateway stopped serving during the outage"
        cluster.restart_redis()
        # The control plane resumes by itself: heartbeats, then a catalog change converges.
        wait_until(lambda: set(cluster.store().live_nodes()) == {"a", "b"}, 15, what="heartbeats to resume")
        wait_until(lambda: health(url)["redis"] == "ok", 15, what="the gateway to see Redis again")
        cluster.apply_catalog(catalog(cpu=2), name="cpu2.yaml")
        settle(cluster, expected(cpu=2), timeout=60)
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    dead = [p.name for p in procs if not p.alive()]
    assert not dead, f"processes died (none may need a restart): {dead}"

    store = cluster.store()
    assert read_applied(store).version == before["catalog"] + 1  # the version before the outage, then ours
    assert store.catalog_history(50)[1:] == before["history"]
    assert store.api_key_table() == before["keys"]
    after = identities(store)
    assert {rid: after.get(rid) for rid in before["records"]} == before["records"], "an engine was restarted"
    assert len(engines(token)) == sum(expected(cpu=2).values())

    # Usage: everything the clients were served is counted, except at most what was flushed in the last
    # second before the kill (appendfsync everysec) plus one flush interval; never more than was served.
    done = sorted(t for loop in loops for t in loop.done_at)
    at_risk = sum(1 for t in done if killed_at - FSYNC - FLUSH <= t <= killed_at)

    def counted() -> bool:
        return usage_requests(cluster, key_id) >= served - at_risk

    wait_until(counted, 10, interval=0.2, what=f"usage of {served} requests (at most {at_risk} lost) to be counted")
    assert usage_requests(cluster, key_id) <= served, "usage counted twice"
    print(f"Redis down {OUTAGE:.0f}s: {served} requests, 0 errors; usage counted "
          f"{usage_requests(cluster, key_id)} of {served} ({at_risk} at risk in the last second)")


def test_redis_wiped_keeps_engines_and_starts_no_second_set(cluster):
    token = os.environ[TOKEN_VAR]
    [url] = start_fleet(cluster)
    store = cluster.store()
    before = identities(store)
    want = sum(expected().values())

    loops = start_loops(url, "chat", streaming=2, plain=2)
    try:
        wait_until(lambda: sum(loop.ok for loop in loops) > 20, 30, what="traffic before the wipe")
        cluster.kill_redis()
        cluster.restart_redis(wipe=True)

        def one_set():
            errors = [e for loop in loops for e in loop.errors]
            assert not errors, f"clients saw errors after the wipe: {errors[:3]}"
            running = engines(token)
            assert len(running) == want, f"{len(running)} engines after the wipe, want {want}: {running}"

        # Several reconcile passes (1 s apart here) run without a catalog: none may start engines.
        hold(8, one_set)
        wait_until(lambda: {r.id for r in cluster.store().all_replicas()} == set(before), 15,
                   what="the agents to register their running engines again")
        status = cluster.llmgw("status").stdout
        assert "no catalog" in status and "llmgw catalog apply" in status, status
        control_log = cluster.procs.get("control").log(400)
        assert "no catalog" in control_log and "llmgw catalog apply" in control_log, control_log

        cluster.apply_catalog(catalog(), name="again.yaml")
        settle(cluster, expected(), timeout=60)
        wait_until(lambda: health(url)["endpoints_version"] >= 1 and health(url)["endpoints"] == want, 20,
                   what="the gateway to take the list published after the re-apply")
        hold(2, one_set)
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    after = identities(cluster.store())
    assert {rid: after.get(rid)[0] for rid in before} == {rid: v[0] for rid, v in before.items()}, \
        "an engine was replaced"
    print(f"Redis wiped: {served} requests, 0 errors; the {want} engines kept serving and were registered again")
