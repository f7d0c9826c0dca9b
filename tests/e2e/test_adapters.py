"""LoRA adapters end to end on sim engines (issue 28): redis-server, a control worker, beat, node agents,
the gateway under gunicorn, sim engines serving adapters as vLLM does (runtime loads).

- three adapters on two replicas with `max_loras: 2`: a request for each is answered by a replica
  that holds it (the sim's answer names the adapter that served it), `/v1/models` lists them with
  their `parent`, and a replica's engine is asked for nothing it does not hold;
- an engine killed: the agent restarts it and loads its adapters again; the agent killed: the next
  one adopts the engine and keeps what it holds;
- an adapter added and then removed by a catalog apply while clients loop over the others: no
  request fails, and the removed one ends unloaded everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests
import yaml

from tests.support.clients import start_loops, stop_loops
from harness.cluster import FAST_AGENT
from harness.procs import wait_until

pytestmark = pytest.mark.slow

AGENT = {**FAST_AGENT, "LLMGW_AGENT_ADAPTER_UNLOAD_GRACE": "1"}


def adapter_dir(tmp_path, name: str, rank: int = 8) -> str:
    d = tmp_path / "adapters" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(d)


def catalog(tmp_path, names, replicas: int = 2, max_loras: int = 2, **adapter) -> str:
    prof = {"name": "cpu", "engine": "sim", "replicas": replicas, "lora": {"max_loras": max_loras},
            "args": ["--step-ms", "5", "--lora-load-time", "0.2"]}
    ads = [{"name": n, "source": adapter_dir(tmp_path, n), "rank": 8, **adapter} for n in names]
    return yaml.safe_dump({"models": [{"name": "base", "profiles": [prof], "adapters": ads}]}, sort_keys=False)


def ask(url: str, model: str, max_tokens: int = 3) -> tuple[int, dict]:
    r = requests.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
    return r.status_code, r.json()


def listed(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in requests.get(url + "/v1/models", timeout=5).json()["data"]}


def served(cluster) -> dict[str, list[str]]:
    """Replica id -> the adapters its record says its engine holds now."""
    return {r.id: r.holds for r in cluster.store().all_replicas() if r.stop_requested_at is None}


def engine_holds(rec) -> list[str]:
    """What the engine itself lists (GET /v1/models, cards with a parent)."""
    doc = requests.get(rec.url + "/v1/models", timeout=5, headers={"Authorization": f"Bearer {rec.engine_secret}"}).json()
    return sorted(c["id"] for c in doc["data"] if c.get("parent"))


def test_three_adapters_on_two_replicas_each_answered_by_a_holder(cluster, tmp_path):
    [url] = cluster.start_system(catalog(tmp_path, ["a1", "a2", "a3"]), nodes=("a", "b"), node_env=AGENT,
                                 routed=2)
    # Every adapter on at least one replica; no replica over max_loras.
    wait_until(lambda: {a for held in served(cluster).values() for a in held} == {"a1", "a2", "a3"}, 60,
               what="every adapter loaded somewhere")
    assert all(len(h) <= 2 for h in served(cluster).values())
    wait_until(lambda: all(listed(url).get(a, {}).get("ready_replicas") for a in ("a1", "a2", "a3")), 20,
               what="the gateway to list every adapter as held")
    models = listed(url)
    assert {models[a]["parent"] for a in ("a1", "a2", "a3")} == {"base"}
    recs = {r.id: r for r in cluster.store().all_replicas()}
    for name in ("a1", "a2", "a3"):
        for _ in range(6):
            status, doc = ask(url, name)
            assert status == 200, doc
            text = doc["choices"][0]["message"]["content"]
            assert text.startswith(f"[{name}] "), text  # the adapter served it, not the base model
    # Each replica's engine holds exactly what its record says (nothing was loaded behind llmgw's back).
    # The requests above make busy adapters wanted on more replicas, so a load may be on its way:
    # the two agree once it is recorded.
    wait_until(lambda: all(engine_holds(recs[rid]) == sorted(held) for rid, held in served(cluster).items()), 30,
               what="each engine to hold what its record says")
    status, doc = ask(url, "base")
    assert status == 200 and not doc["choices"][0]["message"]["content"].startswith("["), doc


def test_an_engine_killed_gets_its_adapters_back_after_the_restart(cluster, tmp_path):
    [url] = cluster.start_system(catalog(tmp_path, ["a1"], replicas=1, max_loras=1), node_env=AGENT, routed=1)
    wait_until(lambda: list(served(cluster).values()) == [["a1"]], 60, what="a1 loaded")
    (rec,) = cluster.store().all_replicas()
    os.kill(rec.engine_pid, signal.SIGKILL)
    wait_until(lambda: (r := cluster.store().get_replica(rec.id)) and r.attempt > rec.attempt and r.holds == ["a1"],
               90, what="the restarted engine to hold a1 again")
    again = cluster.store().get_replica(rec.id)
    assert engine_holds(again) == ["a1"]
    wait_until(lambda: ask(url, "a1")[0] == 200, 30, what="a1 to be served again")
    loaded = [e for e in cluster.store().read_events() if e.replica == rec.id and e.kind == "adapter_loaded"]
    assert len(loaded) == 2, loaded
    # kill -9 the agent and start it again: it adopts the engine, asks it what it holds, loads nothing again.
    cluster.procs.get("node-a").kill9()
    assert ask(url, "a1")[0] == 200  # the engine serves on while its agent is gone
    cluster.start_node("a", **AGENT)
    adopted = wait_until(lambda: (r := cluster.store().get_replica(rec.id)).adopted_at and r, 60,
                         what="the engine to be adopted")
    assert adopted.attempt == again.attempt and adopted.holds == ["a1"] and engine_holds(adopted) == ["a1"]
    wait_until(lambda: ask(url, "a1")[0] == 200, 30, what="a1 served after the adoption")
    assert [e for e in cluster.store().read_events() if e.replica == rec.id and e.kind == "adapter_loaded"] == loaded


def test_an_adapter_added_and_removed_by_apply_with_clients_running_fails_no_request(cluster, tmp_path):
    [url] = cluster.start_system(catalog(tmp_path, ["a1"]), nodes=("a",), node_env=AGENT, routed=2)
    wait_until(lambda: ask(url, "a1")[0] == 200, 60, what="a1 served")
    loops = start_loops(url, "a1", streaming=1, plain=2, max_tokens=4) + start_loops(url, "base", 1, 1, 4)
    try:
        cluster.apply_catalog(catalog(tmp_path, ["a1", "a2"]))
        wait_until(lambda: ask(url, "a2")[0] == 200, 60, what="a2 added and served")
        status, doc = ask(url, "a2")
        assert doc["choices"][0]["message"]["content"].startswith("[a2] ")
        before = sum(loop.ok for loop in loops)
        cluster.apply_catalog(catalog(tmp_path, ["a1"]))
        try:
            wait_until(lambda: all("a2" not in h for h in served(cluster).values()), 60, what="a2 unloaded everywhere")
        except AssertionError as e:
            recs = cluster.store().all_replicas()
            raise AssertionError(f"{e}; records: {[(r.id, r.adapters_wanted, r.holds, r.adapter_failures) for r in recs]}; "
                                 f"loads: {cluster.store().loads([r.id for r in recs])}") from None
        wait_until(lambda: ask(url, "a2")[0] == 404, 20, what="a2 unknown again")
        wait_until(lambda: sum(loop.ok for loop in loops) > before + 20, 30, what="the clients to go on")
    finally:
        ok, errors = stop_loops(loops)
    assert not errors, errors[:5]
    recs = cluster.store().all_replicas()
    assert all("a2" not in engine_holds(r) for r in recs)
    print(f"adapter added and removed under load: {ok} requests, 0 errors")
