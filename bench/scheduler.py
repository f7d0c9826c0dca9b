"""How long one reconcile plan (placement included) takes on a large fleet: 1,000 nodes, 10,000 replicas.

    python -m bench.scheduler [--repeat 5]

Two cases, each timed as the best of --repeat runs of `plan(catalog, snapshot, now)`:

- cold: nothing runs yet; all 10,000 replicas are placed in one pass (GPU bin-packing + CPU spread);
- steady: the 10,000 replicas run and are Ready, one GPU node and one CPU node just died (their
  replicas are Lost and replaced), one model's spec changed (rolling update) and one node drains.

Target: under 100 ms per plan. Exits 1 if a case's CPU time misses it by more than 3x (a shared CI box
is noisy).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from llmgw.catalog import parse_catalog
from llmgw.gpus import parse_gpu_spec
from llmgw.state.node_records import NodeAdmin, NodeInfo
from workers.control.gcpause import paused_gc
from workers.control.plan import CreateReplica, plan
from workers.control.snapshot import Snapshot

TARGET_MS = 100.0


def fleet() -> dict[str, NodeInfo]:
    nodes = {}
    for i in range(500):  # 4,000 h100
        n = f"h100-{i:04d}"
        nodes[n] = NodeInfo(name=n, gpus=parse_gpu_spec("h100:8"), pool="gpu", labels={"zone": f"z{i % 4}"})
    for i in range(200):  # 800 l4
        n = f"l4-{i:04d}"
        nodes[n] = NodeInfo(name=n, gpus=parse_gpu_spec("l4:4"), pool="gpu", labels={"zone": f"z{i % 4}"})
    for i in range(300):
        n = f"cpu-{i:04d}"
        nodes[n] = NodeInfo(name=n, pool="cpu", labels={"zone": f"z{i % 4}"})
    return nodes


def catalog_doc() -> dict:
    """10,000 replicas: 2,150 on h100 (3,400 of 4,000 GPUs), 700 on l4 (of 800), 7,150 on CPU."""
    models = []
    for i in range(20):  # 20 x 80 x 1 GPU
        models.append({"name": f"g1-{i}", "profiles": [{"name": "h100", "engine": "vllm", "replicas": 80,
                                                         "pool": "gpu", "gpu": {"class": "h100"}}]})
    for i in range(10):  # 10 x 50 x 2 GPUs
        models.append({"name": f"g2-{i}", "profiles": [{"name": "h100", "engine": "vllm", "replicas": 50,
                                                         "pool": "gpu", "tensor_parallel": 2, "priority": 5,
                                                         "gpu": {"class": "h100"}}]})
    for i in range(5):  # 5 x 10 x 8 GPUs on each of two nodes
        models.append({"name": f"g16-{i}", "profiles": [{"name": "h100x2", "engine": "vllm", "replicas": 10,
                                                          "pool": "gpu", "tensor_parallel": 8, "pipeline_parallel": 2,
                                                          "nodes": 2, "priority": 10, "gpu": {"class": "h100"}}]})
    for i in range(7):  # 7 x 100 x 1 l4
        models.append({"name": f"l4-{i}", "profiles": [{"name": "l4", "engine": "vllm", "replicas": 100,
                                                         "pool": "gpu", "gpu": {"class": "l4"}}]})
    for i in range(72):  # 71 x 100 + 50 on CPU, a few pinned to a zone
        prof = {"name": "cpu", "engine": "sim", "replicas": 100 if i else 50, "pool": "cpu"}
        if i % 10 == 0:
            prof["node_selector"] = {"zone": "z1"}
        models.append({"name": f"c-{i}", "profiles": [prof]})
    return {"models": models}


def timed(fn, repeat: int) -> tuple[float, float, object]:
    """Best wall time and best CPU time of `repeat` runs, in ms, with the GC paused as the reconcile
    shell runs plan. On a shared machine the CPU time (which a descheduled process does not accrue)
    is the fairer figure; both are printed."""
    best_wall, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        with paused_gc():
            out = fn()
        best_cpu = min(best_cpu, time.process_time() - c)
        best_wall = min(best_wall, time.perf_counter() - t)
    return best_wall * 1000, best_cpu * 1000, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    cat = parse_catalog(catalog_doc())
    nodes = fleet()
    now = 1_000_000.0
    want = cat.total_replicas()
    empty = Snapshot(nodes=nodes, known=frozenset(nodes), taken_at=now)

    cold_ms, cold_cpu, actions = timed(lambda: plan(cat, empty, now), args.repeat)
    creates = [a for a in actions if isinstance(a, CreateReplica)]
    placed = sum(1 for a in creates if a.placement)
    print(f"cold:   {len(nodes)} nodes, {want} replicas wanted: {placed} placed, "
          f"{len(creates) - placed} pending, plan {cold_ms:.1f} ms (cpu {cold_cpu:.1f} ms)")

    # Steady state: every replica placed above runs and is Ready.
    t0 = now
    recs = []
    for a in creates:
        if not a.placement:
            continue
        r = a.record(t0 - 600)
        recs.append(dataclasses.replace(r, started_at=t0 - 590, first_ready_at=t0 - 580, last_probe_ok=True,
                                        last_probe_at=t0 - 1, port=20000, url=f"http://{r.node}:20000"))
    dead = {"h100-0007", "cpu-0011"}
    live = {n: i for n, i in nodes.items() if n not in dead}
    doc = catalog_doc()
    doc["models"][3]["profiles"][0]["args"] = ["--max-model-len", "8192"]  # g1-3: rolling update
    cat2 = parse_catalog(doc)
    admin = {"h100-0100": NodeAdmin(cordoned=True, draining=True)}
    last_seen = {n: (now - 10 if n in dead else now) for n in nodes}  # the dead went quiet 10 s ago
    steady = Snapshot(nodes=live, replicas=tuple(recs), admin=admin, known=frozenset(nodes), taken_at=now,
                      last_seen=last_seen)
    steady_ms, steady_cpu, actions2 = timed(lambda: plan(cat2, steady, now), args.repeat)
    kinds: dict[str, int] = {}
    for a in actions2:
        kinds[type(a).__name__] = kinds.get(type(a).__name__, 0) + 1
    print(f"steady: {len(live)} live nodes, {len(recs)} replicas: plan {steady_ms:.1f} ms "
          f"(cpu {steady_cpu:.1f} ms), actions {kinds}")
    print(f"target: < {TARGET_MS:.0f} ms per plan")
    worst = max(cold_cpu, steady_cpu)
    return 0 if worst < TARGET_MS * 3 else 1


if __name__ == "__main__":
    sys.exit(main())
