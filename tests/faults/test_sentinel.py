"""Redis as production runs it: the master behind Sentinel is killed (-9) under load (issue 53).

The whole system (control worker, beat, two node agents, the gateway, the CLI) runs on
`redis+sentinel://` (harness/sentinel.py: a master, a replica, three sentinels; a password).

1. A catalog apply and a key creation just before the master is killed, while clients stream and
   not (and Flower watches): no client error, the catalog and the key are on the promoted replica (each waited for a replica:
   WAIT), every process reconnects there by itself (heartbeats, gateway reports, Celery tasks), every
   replica record is reconciled, new replicas are placed and routed after the failover, and once the
   old master is back (as a replica) no llmgw process is connected to it.
2. What a control pass wrote that the replica never received (the replica frozen while the pass runs,
   then the master killed) is lost in the failover, and written again by the next passes: the
   level-based design redoes it. Exactly the catalog's replicas, no orphan engine, no engine twice.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from llmgw.catalog import read_applied
from tests.faults.fleet import catalog, engines, expected, identities, settle, start_fleet
from tests.support.clients import start_loops, stop_loops
from harness.procs import TOKEN_VAR, free_port, hold, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow]

PASSWORD = "s3cret/pw"


def is_redis(name: str) -> bool:
    return name.startswith(("redis-", "sentinel-"))


def no_errors(loops):
    def check():
        errors = [e for loop in loops for e in loop.errors]
        assert not errors, f"clients saw errors: {errors[:3]}"
    return check


def flower_workers(port: int) -> set[str]:
    """The workers Flower's broadcast reached now (`refresh=1`)."""
    try:
        resp = requests.get(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=10)
    except requests.RequestException:
        return set()
    return {w.split("@")[0] for w in resp.json()} if resp.status_code == 200 else set()


def fresh_everywhere(cluster, since: float, gateways: int = 1) -> bool:
    """Every node agent's heartbeat and every gateway's report were written after `since` (on the
    master the URL leads to now): each process writes there again."""
    store = cluster.store()
    try:
        seen = store.nodes_last_seen()
        reports = store.gateway_reports()
        return (all(seen.get(n, 0) > since for n in ("a", "b"))
                and len([g for g in reports if g.at > since]) >= gateways)
    finally:
        store.close()


def test_master_killed_under_load_loses_no_apply_no_key_and_leaves_nobody_behind(cluster):
    cluster.start_sentinel_redis(password=PASSWORD)
    [url] = start_fleet(cluster)
    team = cluster.llmgw("keys", "create", "team").stdout.strip()
    auth = {"Authorization": f"Bearer {team}"}
    wait_until(lambda: requests.post(url + "/v1/chat/completions", json={"model": "chat"}, timeout=5).status_code
               == 401, 20, what="the gateway to require the key")
    flower = free_port()
    cluster.start_flower(flower, FLOWER_UNAUTHENTICATED_API="true")
    wait_until(lambda: {"control", "a", "b"} <= flower_workers(flower), 60, interval=0.5,
               what="Flower to see the workers")
    procs = [p for p in cluster.procs.procs if not is_redis(p.name)]
    before = identities(cluster.store())

    loops = start_loops(url, "chat", streaming=2, plain=2, headers=auth)
    try:
        wait_until(lambda: sum(loop.ok for loop in loops) > 20, 30, what="traffic before the kill")
        # Just before the kill: one more CPU replica, and a new key. Each returns once a replica has it.
        applied = cluster.apply_catalog(catalog(cpu=2), name="cpu2.yaml")
        made = cluster.llmgw("keys", "create", "late")
        assert "warning" not in applied.stderr + made.stderr, applied.stderr + made.stderr
        late = made.stdout.strip()
        store = cluster.store()
        version, table = read_applied(store).version, store.api_key_table()
        store.close()

        killed = time.monotonic()
        old = cluster.ha.kill_master()
        new = cluster.ha.wait_failover(old)
        promoted, promoted_at = time.monotonic() - killed, time.time()
        wait_until(lambda: fresh_everywhere(cluster, promoted_at), 30, interval=0.1,
                   what="every agent and gateway to write to the new master")
        reconnected = time.monotonic() - killed
        no_errors(loops)()

        store = cluster.store()
        assert read_applied(store).version == version, "the catalog applied before the kill was lost"
        assert store.api_key_table() == table, "a key created before the kill was lost"
        settle(cluster, expected(cpu=2), timeout=90)  # every record reconciled, the new replica placed
        cluster.wait_routed(sum(expected(cpu=2).values()))
        # After the failover: new replicas are placed, started and routed (Celery tasks, beat, agents).
        cluster.apply_catalog(catalog(cpu=3), name="cpu3.yaml")
        settle(cluster, expected(cpu=3), timeout=90)
        cluster.wait_routed(sum(expected(cpu=3).values()))
        late_ok = requests.post(url + "/v1/chat/completions", timeout=10, headers={"Authorization": f"Bearer {late}"},
                                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 4})
        assert late_ok.status_code == 200, late_ok.text
        # Flower follows too: its broker connection (the workers answer its broadcast) and its broker
        # page (queue lengths, read through the sentinels).
        wait_until(lambda: {"control", "a", "b"} <= flower_workers(flower), 30, interval=0.5,
                   what="Flower to see the workers after the failover")
        lengths = requests.get(f"http://127.0.0.1:{flower}/api/queues/length", timeout=10)
        assert lengths.status_code == 200 and "control" in {q["name"] for q in lengths.json()["active_queues"]}, \
            lengths.text

        # The old master comes back, and the sentinels make it a replica of the new one: nobody of ours
        # talks to it (every connection goes where the sentinels say), while they all talk to the new one.
        cluster.ha.restart(old)
        cluster.ha.wait_replica_of(old, new)
        assert cluster.ha.talkers(new), "no client on the new master: the check below would prove nothing"

        def nobody_on_old():
            talking = cluster.ha.talkers(old)
            assert not talking, f"connected to the demoted master: {talking}"
            no_errors(loops)()

        hold(5, nobody_on_old)
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    dead = [p.name for p in procs if not p.alive()]
    assert not dead, f"processes died (none may need a restart): {dead}"
    after = identities(cluster.store())
    assert {rid: after.get(rid) for rid in before} == before, "an engine was restarted"
    # Beat (which no test step waits on) sends its timers again after the failover: its log goes on
    # with sends after the last task it could not apply.
    beat = cluster.procs.get("beat").log(100_000).splitlines()
    failed = [i for i, line in enumerate(beat) if "Couldn't apply scheduled task" in line]
    assert any("Sending due task" in line for line in beat[(failed[-1] + 1 if failed else 0):]), \
        "beat sent nothing after the failover"
    print(f"Sentinel failover under load: {served} requests, 0 errors; the sentinels promoted {new} "
          f"{promoted:.1f}s after the kill, every agent and gateway wrote there {reconnected:.1f}s after it; "
          f"catalog version {version} and the key kept")


def test_writes_the_replica_never_got_are_redone_by_the_next_passes(cluster):
    token = os.environ[TOKEN_VAR]
    # A replica cut off for longer than 10 x down-after is not promoted: leave room for a slow launch.
    cluster.start_sentinel_redis(password=PASSWORD, down_after=3000)
    [url] = start_fleet(cluster)
    loops = start_loops(url, "chat", streaming=1, plain=1)
    control = cluster.procs.get("control")
    try:
        wait_until(lambda: sum(loop.ok for loop in loops) > 10, 30, what="traffic before the fault")
        # The control worker is held while the apply lands (WAIT: the replica has it), then the replica
        # is cut off and the worker let go: the pass that places the new replica, and what the agent
        # then records of its engine, reach the master alone.
        control.signal_group(signal.SIGSTOP)
        try:
            cluster.apply_catalog(catalog(cpu=2), name="cpu2.yaml")
            store = cluster.store()
            known = set(identities(store))
            replica = next(n for n in ("redis-a", "redis-b") if n != cluster.ha.master())
            cluster.ha.cut_replication(replica)
        finally:
            control.signal_group(signal.SIGCONT)

        def placed_and_started() -> set[str]:
            fresh = {r.id for r in store.all_replicas() if r.id not in known and r.engine_pid}
            return fresh if fresh and set(engines(token).values()) & fresh else set()

        lost = wait_until(placed_and_started, 60, what="the new replica's engine to run (recorded on the master alone)")
        store.close()
        old = cluster.ha.kill_master()
        cluster.ha.mend_replication(replica)
        new = cluster.ha.wait_failover(old)
        assert new == replica
        store = cluster.store()
        missing = lost - set(identities(store))
        assert missing == lost, f"the promoted replica has {lost - missing}: nothing was lost, nothing to redo"
        # The next passes write them again (the agent reports its running engine, the reconcile pass
        # plans against the catalog): exactly the catalog's replicas, each with one engine, no orphan.
        settle(cluster, expected(cpu=2), timeout=90)
        cluster.wait_routed(sum(expected(cpu=2).values()))
        hold(2, no_errors(loops))
        cluster.ha.restart(old)
        cluster.ha.wait_replica_of(old, new)
        assert not cluster.ha.talkers(old), cluster.ha.talkers(old)
    finally:
        served, errors = stop_loops(loops)
    assert not errors, errors[:5]
    print(f"lost pass redone: {served} requests, 0 errors; {len(engines(token))} engines for "
          f"{sum(expected(cpu=2).values())} replicas")
