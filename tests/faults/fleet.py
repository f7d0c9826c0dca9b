"""What the fault tests share: a small fleet on real processes, and the invariants every fault must
leave intact once the system has settled again.

The invariants are read from Redis and from /proc, never from what a component says about itself:
- exactly the catalog's number of replicas per profile (not asked to stop, all Ready);
- every GPU index of every node held by at most one replica that is not Stopped;
- no orphan engine: every engine process on the machine that carries this test's token belongs to a
  replica record, and is that record's current engine.
"""

from __future__ import annotations

import time
from collections import Counter

from llmgw.proc.proctable import REPLICA_ENV, read_environ, read_proc
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State, derive, nodes_alive
from llmgw.state.store import Store
from harness.cluster import FAST_AGENT
from harness.procs import TOKEN_VAR, pids_with_env, wait_until

# Agents that react fast, and stop an engine that ignores SIGTERM after 3 s.
AGENT = {**FAST_AGENT, "LLMGW_AGENT_STOP_GRACE": "3"}

# Two GPU replicas (bin-packed onto h100s) and one CPU replica of one model, all sim engines.
CATALOG = """
models:
  - name: chat
    aliases: [chat-latest]
    profiles:
      - name: gpu
        engine: sim
        replicas: {gpu}
        gpu: {{class: h100, count: 1}}
        capacity: 16
        drain_timeout: 20
      - name: cpu
        engine: sim
        replicas: {cpu}
        capacity: 16
        drain_timeout: 20
"""


def catalog(gpu: int = 2, cpu: int = 1) -> str:
    return CATALOG.format(gpu=gpu, cpu=cpu)


def expected(gpu: int = 2, cpu: int = 1) -> dict[tuple[str, str], int]:
    return {("chat", "gpu"): gpu, ("chat", "cpu"): cpu}


def start_fleet(cluster, nodes=("a", "b"), gpus: str = "h100:2", gateways: int = 1, redis: dict | None = None,
                node_env: dict | None = None, **catalog_kw) -> list[str]:
    """The system (Cluster.start_system) with the catalog applied, settled and routed by every gateway.
    Returns the gateway URLs."""
    urls = cluster.start_system(catalog(**catalog_kw), nodes=nodes, gpus=gpus, gateways=gateways, redis=redis,
                                node_env={**AGENT, **(node_env or {})})
    settle(cluster, expected(**catalog_kw), timeout=90)
    cluster.wait_routed(sum(expected(**catalog_kw).values()), urls, timeout=30)
    return urls


# --- the invariants --------------------------------------------------------------------------------
def current(store: Store) -> list[ReplicaRecord]:
    return [r for r in store.all_replicas() if r.stop_requested_at is None]


def states(store: Store) -> dict[str, State]:
    live, now = store.live_nodes(), time.time()
    return {r.id: derive(r, nodes_alive(r, live), now).state for r in store.all_replicas()}


def gpu_conflicts(records: list[ReplicaRecord], state: dict[str, State]) -> dict[tuple[str, int], list[str]]:
    """(node, GPU index) -> the replicas holding it, where more than one replica that is not Stopped does."""
    holders: dict[tuple[str, int], list[str]] = {}
    for r in records:
        if state.get(r.id) is State.STOPPED:
            continue
        for node, idxs in r.gpus.items():
            for i in idxs:
                holders.setdefault((node, i), []).append(r.id)
    return {k: v for k, v in holders.items() if len(v) > 1}


def engines(token: str) -> dict[int, str]:
    """Every engine process of this test on the machine (found by the test's token in its environment,
    not by what any component recorded): pid -> the replica id in its environment."""
    out = {}
    for pid in pids_with_env(TOKEN_VAR, token):
        info = read_proc(pid)
        # `python -m simengine ...`; the shim's own command line names it too, after `shim.py`.
        if info is None or info.cmdline[1:3] != ("-m", "simengine"):
            continue
        out[pid] = read_environ(pid).get(REPLICA_ENV, "?")
    return out


def orphans(store: Store, token: str) -> list[str]:
    """Engine processes that no record accounts for (no record, or not the record's current engine)."""
    recs = {r.id: r for r in store.all_replicas()}
    out = []
    for pid, rid in engines(token).items():
        rec = recs.get(rid)
        if rec is None:
            out.append(f"pid {pid}: replica {rid} has no record")
        elif rec.engine_pid not in (None, pid):
            out.append(f"pid {pid}: replica {rid}'s record names engine {rec.engine_pid}")
    return out


def problems(cluster, want: dict[tuple[str, str], int], token: str) -> list[str]:
    """What is not as it should be once the fleet has settled (empty: all is well)."""
    store = cluster.store()
    recs = store.all_replicas()
    state = states(store)
    out = []
    counts = Counter((r.model, r.profile) for r in recs if r.stop_requested_at is None)
    if dict(counts) != want:
        out.append(f"replicas per profile {dict(counts)}, want {want}")
    leftover = [f"{r.id} {state[r.id].value}" for r in recs if r.stop_requested_at is not None]
    if leftover:
        out.append(f"replicas still stopping: {leftover}")
    not_ready = [f"{r.id} {state[r.id].value}" for r in recs
                 if r.stop_requested_at is None and state[r.id] is not State.READY]
    if not_ready:
        out.append(f"not Ready: {not_ready}")
    conflicts = gpu_conflicts(recs, state)
    if conflicts:
        out.append(f"GPUs held twice: {conflicts}")
    out += orphans(store, token)
    per_replica = Counter(engines(token).values())
    out += [f"replica {rid} has {n} engine processes" for rid, n in per_replica.items() if n > 1]
    return out


def settle(cluster, want: dict[tuple[str, str], int], timeout: float = 60, token: str | None = None) -> None:
    """Wait until `problems` is empty; fail with what is still wrong."""
    import os

    token = token or os.environ[TOKEN_VAR]
    last: list[str] = []

    def ok() -> bool:
        nonlocal last
        last = problems(cluster, want, token)
        return not last

    try:
        wait_until(ok, timeout, interval=0.2, what="the fleet to settle")
    except AssertionError as e:
        raise AssertionError(f"{e}: {last}") from None


def identities(store: Store) -> dict[str, tuple]:
    """Per replica, what a restart would change: its engine pid, attempt and restarts."""
    return {r.id: (r.engine_pid, r.attempt, r.restarts) for r in store.all_replicas()}
