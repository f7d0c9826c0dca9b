"""The event history and `llmgw explain` on real processes: a crash, its restart and catalog applies
appear in `llmgw events --json` in order (and reach a follower at once); `llmgw explain` says why a
model is Pending (no node has its GPU class) or crash-looping, and exits 0 only for a Ready one."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from harness.cluster import sim_catalog
from harness.procs import python, wait_until

pytestmark = pytest.mark.slow

AGENT = {"LLMGW_AGENT_TICK": "0.2", "LLMGW_AGENT_BACKOFF_BASE": "0.2"}




def events_json(cluster, *args: str) -> list[dict]:
    out = cluster.llmgw("events", "--json", "-n", "1000", *args).stdout
    return [json.loads(line) for line in out.splitlines()]


def start(cluster, node_gpus: str = ""):
    cluster.start_system(gpus=node_gpus, node_env=AGENT, gateways=0)
    return cluster.store()


def test_a_crash_a_restart_and_applies_are_in_the_history_in_order(cluster, tmp_path):
    store = start(cluster)
    cluster.apply_catalog(sim_catalog(1))
    wait_until(lambda: [r for r in store.all_replicas() if r.first_ready_at], 30, what="the replica Ready")
    (rec,) = store.all_replicas()
    follower = subprocess.Popen([python(), "-m", "llmgw", "events", "-f", "--json", "--kind", "catalog_applied"],
                                env={**os.environ, **cluster.env()}, stdout=open(tmp_path / "follow.out", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        os.kill(rec.engine_pid, signal.SIGKILL)
        wait_until(lambda: (r := store.get_replica(rec.id)) and r.attempt >= 2 and r.first_ready_at
                   and r.first_ready_at >= r.started_at, 30, what="the killed engine restarted and Ready")
        cluster.apply_catalog(sim_catalog(2))
        # Like tail -f: the last matching events first (version 1), then each new one as it is appended.
        wait_until(lambda: '"version": 2' in (tmp_path / "follow.out").read_text(), 15, what="the follower's line")
    finally:
        follower.terminate()
        follower.wait(10)
    followed = [json.loads(x) for x in (tmp_path / "follow.out").read_text().splitlines()]
    assert [e["data"]["version"] for e in followed] == [1, 2]

    history = events_json(cluster)
    ids = [e["id"] for e in history]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))  # oldest first

    def first(kind, **match):
        return next(i for i, e in enumerate(history) if e["kind"] == kind
                    and all(e.get(k) == v or e["data"].get(k) == v for k, v in match.items()))

    applied1 = first("catalog_applied", version=1)
    placed = first("replica_placed", replica=rec.id)
    failed = first("replica_failed", replica=rec.id)
    restarted = first("replica_restarted", replica=rec.id)
    ready2 = next(i for i, e in enumerate(history) if e["kind"] == "replica_ready" and e["replica"] == rec.id
                  and "attempt 2" in e["message"])
    applied2 = first("catalog_applied", version=2)
    assert applied1 < placed < failed < restarted < ready2 < applied2
    assert "killed by SIGKILL" in history[failed]["message"] and history[failed]["node"] == "a"
    assert history[failed]["source"] == "agent:a" and history[applied2]["source"]
    # Filters: only this replica's model and kinds.
    mine = events_json(cluster, "--model", "chat", "--kind", "replica_*")
    assert mine and all(e["model"] == "chat" and e["kind"].startswith("replica_") for e in mine)


EXPLAIN = """
models:
  - name: big
    profiles:
      - name: gpu
        engine: sim
        replicas: 1
        gpu: {class: h100, count: 1}
  - name: crashy
    profiles:
      - name: cpu
        engine: sim
        replicas: 1
        args: ["--fail-start"]
  - name: fine
    profiles:
      - name: cpu
        engine: sim
        replicas: 1
"""


def test_explain_a_pending_model_and_a_crash_loop(cluster):
    store = start(cluster, node_gpus="a10g:1")
    cluster.apply_catalog(EXPLAIN)
    wait_until(lambda: json.loads(cluster.llmgw("status", "--json").stdout)["replica_states"].get("CrashLoop"), 60,
               what="crashy in a crash loop")
    wait_until(lambda: cluster.llmgw("explain", "fine", check=False).returncode == 0, 30, what="fine Ready")

    pending = cluster.llmgw("explain", "big", check=False)
    assert pending.returncode == 1, pending.stdout + pending.stderr
    (big,) = [r for r in store.all_replicas() if r.model == "big"]
    assert f'{big.id} is Pending for' in pending.stdout
    assert 'no node in pool "default" has h100 GPUs (it has: a10g)' in pending.stdout
    assert "  - a: has no h100 GPUs (it has a10g)" in pending.stdout
    assert "No endpoint of big is published" in pending.stdout

    crash = cluster.llmgw("explain", "crashy", check=False)
    assert crash.returncode == 1, crash.stdout + crash.stderr
    (bad,) = [r for r in store.all_replicas() if r.model == "crashy"]
    assert f"{bad.id} is in a crash loop on a:" in crash.stdout and "exited with code 1" in crash.stdout
    assert "failing at start as asked (--fail-start)" in crash.stdout  # the engine's own last log line

    fine = cluster.llmgw("explain", "fine", check=False)
    assert fine.returncode == 0 and fine.stdout.startswith("fine: 1 of 1 replicas asked for are Ready.")
