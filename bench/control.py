"""How fast the control plane reacts, on real parts (issue 18): events against timers alone.

Real redis-server, a control worker, beat, 4 node agents running sim engines, 2 gateways (gunicorn,
gevent). For each mode (`timers`: LLMGW_EVENT_DRIVEN=0, the periodic passes only; `events`: facts
kick the passes) and `--repeats` times:

- catalog apply -> the first of its 20 sim replicas routable, and -> all 20 routable (the published
  endpoint list, polled every 5 ms);
- a replica turning Ready (its `first_ready_at`) -> in every gateway's table (each gateway process
  reports the endpoint-list version it routes by);
- an engine killed (kill -9) -> its endpoint out of every gateway's table;
- a burst of 100 state changes (kicks, as 100 agents would send them within 0.1 s) -> how many
  reconcile passes ran for it.

Prints p50/p99 of each, per mode, with the machine it ran on. Not a test: nothing is asserted.

    python -m bench.control [--repeats 20] [--modes timers,events] [--reconcile 5 --publish 1] [--replicas 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from llmgw.catalog import apply_catalog, parse_catalog_text
from llmgw.state.kicks import RECONCILE, Kicker, broker_app, celery_sender
from llmgw.state.store import Store
from harness.cluster import Cluster
from harness.procs import wait_until

NODES = ("n1", "n2", "n3", "n4")
REPLICAS = 20

CATALOG = """
models:
  - name: m{n}
    profiles:
      - name: cpu
        engine: sim
        replicas: {replicas}
        capacity: 8
        drain_timeout: 5
"""
EMPTY = "models: []\n"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


class Watch(threading.Thread):
    """Polls the published list and the gateway reports every 5 ms in the background: when each list
    version was published and which ids it held, and when each gateway process first reported routing
    by each version (a gateway writes its report at once after loading a list, stamped `at`)."""

    def __init__(self, store: Store):
        super().__init__(daemon=True)
        self.store = store
        self.published: dict[int, tuple[float, frozenset[str]]] = {}
        self.loaded: dict[str, dict[int, float]] = {}  # gateway id -> version -> first report time
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.005):
            try:
                version, _fp, eps = self.store.read_endpoints()
                if version not in self.published:
                    self.published[version] = (time.time(), frozenset(e.id for e in eps))
                for g in self.store.gateway_reports():
                    seen = self.loaded.setdefault(g.id, {})
                    seen[g.version] = min(seen.get(g.version, g.at), g.at)
            except Exception:  # noqa: BLE001 - a hiccup: poll again
                pass

    def latest(self) -> tuple[int, frozenset[str]]:
        v = max(self.published, default=0)
        return v, self.published.get(v, (0.0, frozenset()))[1]

    def first_with(self, rid: str) -> int | None:
        return min((v for v, (_t, ids) in self.published.items() if rid in ids), default=None)

    def first_without(self, rid: str, after: int) -> int | None:
        return min((v for v, (_t, ids) in self.published.items() if v > after and rid not in ids), default=None)

    def all_gateways_at(self, version: int) -> float | None:
        """When the last gateway process started routing by `version` (or a newer one), else None."""
        times = []
        for seen in self.loaded.values():
            t = min((at for v, at in seen.items() if v >= version), default=None)
            if t is None:
                return None
            times.append(t)
        return max(times) if times else None


def spin(pred, timeout: float, what: str, interval: float = 0.005):
    return wait_until(pred, timeout, interval=interval, what=what)


def run_mode(mode: str, repeats: int, reconcile: float, publish: float, replicas: int = REPLICAS) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in ("apply_first", "apply_all", "ready_to_published",
                                                    "published_to_gateways", "ready_to_gateways",
                                                    "kill_to_gateways", "burst_passes")}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-control-") as tmp:
        env = {"LLMGW_EVENT_DRIVEN": "1" if mode == "events" else "0",
               "LLMGW_RECONCILE_INTERVAL": str(reconcile), "LLMGW_PUBLISH_INTERVAL": str(publish),
               "LLMGW_HEARTBEAT_INTERVAL": "1", "LLMGW_HEARTBEAT_TTL": "6"}
        cluster = Cluster(Path(tmp), extra_env=env)
        try:
            cluster.start_redis()
            for n in NODES:
                cluster.start_node(n)
            cluster.start_control()
            cluster.start_beat()
            for g in ("gw1", "gw2"):
                cluster.start_gateway(name=g)
            store = cluster.store()
            spin(lambda: len(store.live_nodes()) == len(NODES), 30, "the nodes to join", 0.1)
            app = broker_app(cluster.redis_url)
            kicker = Kicker(store, celery_sender(app), enabled=mode == "events")
            watch = Watch(store)
            watch.start()
            for i in range(repeats):
                name = f"m{i}"
                cat = parse_catalog_text(CATALOG.format(n=i, replicas=replicas))
                t0 = time.time()
                apply_catalog(store, cat, source="bench", applied_by="bench/control.py")
                kicker.kick(RECONCILE)  # what `llmgw catalog apply` does after applying

                def routable(name=name) -> int:
                    return sum(1 for r in watch.latest()[1] if r.startswith(name + "-"))

                spin(lambda: routable() >= 1, 120, "the first routable replica")
                out["apply_first"].append(time.time() - t0)
                spin(lambda: routable() >= replicas, 300, "every replica routable")
                out["apply_all"].append(time.time() - t0)
                # Ready (the agent's first_ready_at) -> in every gateway's table.
                recs = [r for r in store.all_replicas() if r.model == name]
                for rec in recs:
                    v = watch.first_with(rec.id)
                    if v is None or rec.first_ready_at is None:
                        continue
                    at = spin(lambda v=v: watch.all_gateways_at(v), 30, "the gateways to load the list")
                    published = watch.published[v][0]
                    out["ready_to_published"].append(max(0.0, published - rec.first_ready_at))
                    out["published_to_gateways"].append(max(0.0, at - published))
                    out["ready_to_gateways"].append(max(0.0, at - rec.first_ready_at))
                # Kill one engine: out of every gateway's table.
                victim = recs[0]
                v_before = watch.latest()[0]
                t0 = time.time()
                os.kill(victim.engine_pid, signal.SIGKILL)
                v_out = spin(lambda: watch.first_without(victim.id, v_before), 60, "the endpoint to be unpublished")
                at = spin(lambda: watch.all_gateways_at(v_out), 30, "the gateways to drop it")
                out["kill_to_gateways"].append(at - t0)
                # A burst of 100 facts, as 100 agents would send them within about 0.1 s.
                time.sleep(0.5)  # let the kill's own passes finish first (a pause, not synchronisation)
                before = store.control_stats().get("reconcile:passes", 0)
                t_burst = time.time()
                for _ in range(100):
                    kicker.kick(RECONCILE)
                    time.sleep(0.001)
                time.sleep(max(0.0, 1.5 - (time.time() - t_burst)))  # the burst's passes run meanwhile
                passes = store.control_stats().get("reconcile:passes", 0) - before
                out["burst_passes"].append(passes)
                # Clean up the round: remove the model, wait for its records to go.
                apply_catalog(store, parse_catalog_text(EMPTY), source="bench", applied_by="bench/control.py")
                kicker.kick(RECONCILE)
                spin(lambda name=name: not [r for r in store.all_replicas() if r.model == name], 120,
                     "the round's replicas to be gone", 0.05)
                print(f"  {mode} round {i + 1}/{repeats}: first {out['apply_first'][-1]:.2f}s, "
                      f"all {out['apply_all'][-1]:.2f}s, kill->gateways {out['kill_to_gateways'][-1]:.2f}s, "
                      f"burst passes {out['burst_passes'][-1]:.0f}", flush=True)
            watch.halt.set()
            app.close()
        finally:
            cluster.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--modes", default="timers,events")
    ap.add_argument("--reconcile", type=float, default=None,
                    help="LLMGW_RECONCILE_INTERVAL for every mode (default: each mode's default)")
    ap.add_argument("--publish", type=float, default=None)
    ap.add_argument("--replicas", type=int, default=REPLICAS,
                    help="sim replicas per apply (20; 1 shows the path without 20 engines booting at once)")
    args = ap.parse_args()
    from llmgw.settings import ControlSettings

    defaults = ControlSettings()
    print(f"bench/control.py on {machine()}; {len(NODES)} nodes, {args.replicas} sim replicas per apply, "
          f"{args.repeats} repeats", flush=True)
    results = {}
    for mode in args.modes.split(","):
        # `timers` is how llmgw behaved before kicks, with that release's intervals (2 s / 1 s).
        reconcile = args.reconcile or (2.0 if mode == "timers" else defaults.reconcile_interval)
        publish = args.publish or (1.0 if mode == "timers" else defaults.publish_interval)
        print(f"mode {mode}: reconcile every {reconcile:g}s, publish every {publish:g}s", flush=True)
        results[mode] = run_mode(mode, args.repeats, reconcile, publish, args.replicas)
    print()
    print(f"| figure | {' | '.join(f'{m} p50 / p99' for m in results)} |")
    print(f"|---|{'---|' * len(results)}")
    labels = {
        "apply_first": "apply -> first routable replica (s)",
        "apply_all": f"apply -> all {args.replicas} routable (s)",
        "ready_to_published": "replica Ready -> in the published list (ms)",
        "published_to_gateways": "list published -> every gateway routes by it (ms)",
        "ready_to_gateways": "replica Ready -> in every gateway's table (ms)",
        "kill_to_gateways": "engine killed -> out of every gateway's table (s)",
        "burst_passes": "reconcile passes in the 1.5 s around a burst of 100 state changes (timer ticks included)",
    }
    for key, label in labels.items():
        cells = []
        for m, r in results.items():
            xs = r[key]
            scale = 1000 if key.endswith(("_gateways", "_published")) and key != "kill_to_gateways" else 1
            fmt = "{:.0f}" if scale == 1000 or key == "burst_passes" else "{:.2f}"
            cells.append(f"{fmt.format(pct(xs, 50) * scale)} / {fmt.format(pct(xs, 99) * scale)}")
        print(f"| {label} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
