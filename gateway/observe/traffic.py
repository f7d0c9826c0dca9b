"""Per-model traffic of the last minutes, for the console's charts: requests, errors, sheds, and
latency and time-to-first-token histograms, in slots of SLOT seconds, summed over every gateway process.

Why not the Prometheus values: they are cumulative and per host (the multiprocess files), so a chart
over the fleet would need a Prometheus. Instead each process counts in memory on the request path (a
few dictionary updates under a lock it holds for microseconds) and adds its counts to the slot's Redis
hash with its usage flush (`Store.add_traffic`, one pipeline, every LLMGW_GATEWAY_USAGE_FLUSH): Redis
sums them, and the console reads the last SLOTS hashes of every gateway at once. `series(...)` turns
them into chart points (pure).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections import defaultdict
from typing import Callable, Mapping

SLOT = 5.0  # seconds per chart point
SLOTS = 72  # points shown: the last 6 minutes
KEEP = SLOT * (SLOTS + 4)  # seconds a slot's hash lives in Redis
# Histogram bucket upper bounds (seconds): 1 ms growing by 25% a step to ~17 min, so a percentile read
# from it is within 25% of the truth.
BOUNDS = tuple(0.001 * 1.25 ** i for i in range(61))


def bucket(seconds: float) -> int:
    """The index of the first bound >= `seconds` (len(BOUNDS) when beyond the last)."""
    return bisect_left(BOUNDS, seconds)


def slot_of(t: float) -> int:
    return int(t // SLOT)


# Field codes while counting (ints: no string is built on the request path); names in Redis.
_N, _ERR, _SHED, _LAT, _TTFT = 0, 1, 2, 1000, 2000


def _field(code: int) -> str:
    if code >= _TTFT:
        return f"ttft{code - _TTFT}"
    if code >= _LAT:
        return f"lat{code - _LAT}"
    return ("n", "err", "shed")[code]


class TrafficCounter:
    """One gateway process's counts since its last flush, by (slot, model, field code)."""

    def __init__(self, time: Callable[[], float]):
        self.time = time
        self.lock = threading.Lock()
        self.counts: dict[tuple[int, str, int], int] = defaultdict(int)

    def request(self, model: str, error: bool = False, shed: bool = False, seconds: float | None = None) -> None:
        """One request of `model` (its canonical name) ended: answered in `seconds` (None when it was
        refused), an error (5xx, or the client left mid-answer), or shed (429)."""
        s = int(self.time() // SLOT)
        with self.lock:
            c = self.counts
            c[(s, model, _N)] += 1
            if error:
                c[(s, model, _ERR)] += 1
            if shed:
                c[(s, model, _SHED)] += 1
            if seconds is not None:
                c[(s, model, _LAT + bisect_left(BOUNDS, seconds))] += 1

    def first_byte(self, model: str, seconds: float) -> None:
        s = int(self.time() // SLOT)
        with self.lock:
            self.counts[(s, model, _TTFT + bisect_left(BOUNDS, seconds))] += 1

    def take(self) -> dict[int, dict[str, int]]:
        """What was counted since the last take, as the fields to add per slot (`<model>:<field>`)."""
        with self.lock:
            counts, self.counts = self.counts, defaultdict(int)
        out: dict[int, dict[str, int]] = {}
        for (s, model, code), n in counts.items():
            out.setdefault(s, {})[f"{model}:{_field(code)}"] = n
        return out


def _percentile(hist: Mapping[int, int], q: float) -> float | None:
    """The q-quantile of a bucketed histogram: the upper bound of the bucket it falls in (the last
    bound for what lies beyond it)."""
    total = sum(hist.values())
    if not total:
        return None
    rank, seen = math.ceil(q * total), 0
    for i in sorted(hist):
        seen += hist[i]
        if seen >= rank:
            return BOUNDS[min(i, len(BOUNDS) - 1)]
    return None  # pragma: no cover - the loop always reaches the rank


def series(stored: Mapping[int, Mapping[str, str]], last_slot: int) -> dict[str, list[dict]]:
    """Chart points per model for the SLOTS slots ending at `last_slot` (a complete one): per point
    its time, requests, errors and sheds per second, latency p50/p99 and TTFT p50/p99 in seconds
    (None without samples). `stored`: slot -> the hash `Store.traffic` read."""
    slots = range(last_slot - SLOTS + 1, last_slot + 1)
    parsed: dict[str, dict[int, dict[str, dict]]] = {}
    for s in slots:
        for key, raw in (stored.get(s) or {}).items():
            model, _, name = key.rpartition(":")
            try:
                n = int(raw)
            except ValueError:
                continue
            point = parsed.setdefault(model, {}).setdefault(s, {"n": 0, "err": 0, "shed": 0, "lat": {}, "ttft": {}})
            if name in ("n", "err", "shed"):
                point[name] += n
            elif name.startswith("lat") and name[3:].isdigit():
                point["lat"][int(name[3:])] = n
            elif name.startswith("ttft") and name[4:].isdigit():
                point["ttft"][int(name[4:])] = n
    out = {}
    for model, by_slot in parsed.items():
        points = []
        for s in slots:
            p = by_slot.get(s) or {"n": 0, "err": 0, "shed": 0, "lat": {}, "ttft": {}}
            points.append({
                "t": s * SLOT,
                "rps": p["n"] / SLOT, "errors": p["err"] / SLOT, "sheds": p["shed"] / SLOT,
                "p50": _percentile(p["lat"], 0.5), "p99": _percentile(p["lat"], 0.99),
                "ttft_p50": _percentile(p["ttft"], 0.5), "ttft_p99": _percentile(p["ttft"], 0.99),
            })
        out[model] = points
    return out
