"""What WAIT costs the writes that must not be lost: a catalog apply (`Store.store_catalog`, the
compare-and-set llmgw catalog apply makes) and an API key's creation (`Store.create_key`), each timed
without WAIT and with WAIT for one replica (`Durability(1, ...)`: on one leased connection, then WAIT
there), on a Sentinel-managed Redis on loopback (harness/sentinel.py: a master, a replica, three
sentinels, append-only files fsynced every second). Also the same writes through a plain `redis://`
URL to the master, to show what going through Sentinel costs a client that already has its
connection (nothing: the sentinels are asked only when a connection is made). Prints the median and
p99 in milliseconds over `--n` writes of each.

    python -m bench.durable [--n 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from llmgw.catalog import apply_catalog, parse_catalog_text
from llmgw.state import keys as K
from llmgw.state.store import Durability, Store, connect
from harness.procs import ProcessSet
from harness.sentinel import SentinelRedis


def catalog(i: int):
    return parse_catalog_text(f"models:\n  - {{name: chat, profiles: [{{name: s, engine: sim, replicas: {i}}}]}}\n")


def timed(n: int, write) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        write(i)
        out.append((time.perf_counter() - t) * 1000)
    return out


def row(name: str, ms: list[float]) -> str:
    ms = sorted(ms)
    return f"{name:58} {statistics.median(ms):7.3f} ms {ms[int(0.99 * (len(ms) - 1))]:8.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300, help="writes of each kind per case")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-durable-"))
    ha = SentinelRedis(root, ProcessSet(root / "logs"))
    try:
        url = ha.start()
        master = f"redis://127.0.0.1:{ha.port(ha.master())}/0"
        cases = [("Sentinel URL, no WAIT", url, Durability(0)), ("Sentinel URL, WAIT for 1 replica", url, Durability(1)),
                 ("plain URL to the master, no WAIT", master, Durability(0))]
        print(f"{args.n} writes of each, {ha.master()} the master, one replica, on loopback")
        print(f"{'write':58} {'median':>10} {'p99':>11}")
        base = 0
        for name, target, durability in cases:
            store = Store(connect(target), durability)
            store.r.delete(K.API_KEYS)  # every case creates keys in an empty table (creation reads it)
            applies = timed(args.n, lambda i: apply_catalog(store, catalog(base + i + 1), source="bench",
                                                            applied_by="bench"))
            base += args.n
            keys = timed(args.n, lambda i: store.create_key(f"k-{base}-{i}"))
            print(row(f"catalog apply, {name}", applies))
            print(row(f"key creation, {name}", keys))
            store.close()
    finally:
        ha.stop()


if __name__ == "__main__":
    main()
