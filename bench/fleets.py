"""The fleets and loads the benchmarks share: bench/fleetsim.py simulates them, bench/routing.py runs
them on real processes (`python -m simengine` engines), bench/prefix.py's four engines are here too.

A `Fleet` is engines (the sim engine's batching model, `simengine.core.SimConfig`, and what the
catalog tells llmgw) with prompt and output length distributions; a `Load` is Poisson arrivals at a
share of the fleet's capacity, with an optional burst.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Iterable

from simengine.core import SimConfig


# --- fleets and loads --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dist:
    """A distribution of token counts: const (a), uniform [a, b], lognormal (median a, sigma b),
    pareto (minimum a, shape b); `cap` bounds every draw."""

    kind: str
    a: float
    b: float = 0.0
    cap: int = 1_000_000

    def sample(self, rng: random.Random) -> int:
        if self.kind == "const":
            v = self.a
        elif self.kind == "uniform":
            v = rng.uniform(self.a, self.b)
        elif self.kind == "lognormal":
            v = rng.lognormvariate(math.log(self.a), self.b)
        elif self.kind == "pareto":
            v = self.a * rng.paretovariate(self.b)
        else:
            raise ValueError(f"unknown distribution {self.kind!r}")
        return max(1, min(self.cap, int(round(v))))

    def mean(self) -> float:
        rng = random.Random(12345)
        return sum(self.sample(rng) for _ in range(20000)) / 20000


@dataclass(frozen=True)
class Engine:
    name: str
    sim: SimConfig
    capacity: int | None = None  # what the catalog tells llmgw (None: not set)
    fail_at: float | None = None  # from then on it refuses connections and drops its streams
    priority: int = 0


@dataclass(frozen=True)
class Fleet:
    name: str
    engines: tuple[Engine, ...]
    prompt: Dist = Dist("const", 100)
    output: Dist = Dist("const", 64)
    # Gateway processes sharing the traffic: each sees the others in the scrapes, and in what they
    # share through Redis every LLMGW_GATEWAY_SHARE_SENDS (their sends and what they hold), as the
    # real gateways do (gateway.server.sendshare).
    gateways: int = 1
    usage: bool = False  # whether answers report their usage (stream_options.include_usage)
    note: str = ""
    make: str = "vllm"  # the engine the sim engines stand for (bench.conversations.MAKES)

    def capacity(self) -> float:
        """Requests per second the fleet completes with every batch full, at nominal speeds: a full
        engine turns over `max_seqs` requests per (their prefills, which stall the whole batch, plus
        one request's decode steps at a full batch)."""
        p, o = self.prompt.mean(), self.output.mean()
        total = 0.0
        for e in self.engines:
            c = e.sim
            total += c.max_seqs / (c.max_seqs * c.prefill_seconds(int(p)) + o * c.decode_seconds(c.max_seqs))
        return total


@dataclass(frozen=True)
class Load:
    """Poisson arrivals at `fraction` of capacity for `seconds`; optionally a burst to
    `burst_fraction` for `burst_seconds` starting at `burst_at`."""

    name: str
    fraction: float
    seconds: float = 40.0
    burst_at: float = 0.0
    burst_seconds: float = 0.0
    burst_fraction: float = 0.0
    sheddable: float = 0.0  # share of requests sent as sheddable
    critical: float = 0.0
    warmup: float = 5.0  # requests arriving before this are served but not counted (routers learn)

    def rate_at(self, capacity: float) -> Callable[[float], float]:
        def rate(t: float) -> float:
            burst = self.burst_seconds and self.burst_at <= t < self.burst_at + self.burst_seconds
            return capacity * (self.burst_fraction if burst else self.fraction)
        return rate

    def peak(self, capacity: float) -> float:
        return capacity * max(self.fraction, self.burst_fraction)


LOADS = {
    "0.5": Load("50%", 0.5), "0.8": Load("80%", 0.8), "0.95": Load("95%", 0.95),
    "burst": Load("burst", 0.8, seconds=40.0, burst_at=15.0, burst_seconds=10.0, burst_fraction=1.5),
}


def fleet_a_engine(name: str, speed: float, max_seqs: int = 8, **kw) -> SimConfig:
    """The issue's batching model: 10 ms steps, +10 % per extra running sequence, 0.02 ms prefill/token."""
    return SimConfig(max_seqs=max_seqs, step_ms=10.0, batch_alpha=0.1, prefill_ms_per_token=0.02, speed=speed, **kw)


def _fleet(name: str, speeds: Iterable[float], *, max_seqs=8, capacity=True, note="", **kw) -> Fleet:
    engines = tuple(Engine(f"e{i}-{s:g}", fleet_a_engine(f"e{i}", s, max_seqs), capacity=max_seqs if capacity else None)
                    for i, s in enumerate(speeds))
    return Fleet(name, engines, note=note, **kw)


# The five fleets of bench/routing.py, as the simulator sees them (the policy was designed on these).
FLEETS = {
    "today": Fleet("today", tuple(
        Engine(n, SimConfig(max_seqs=4, speed=s), capacity=4)
        for n, s in (("fast-1", 1.0), ("fast-2", 1.0), ("half", 0.5), ("quarter", 0.25))),
        output=Dist("const", 16), prompt=Dist("const", 10), note="bench/routing.py's first fleet"),
    "fleet-a": _fleet("fleet-a", (1, 1, 0.5, 0.25), note="the issue's fleet A"),
    "homogeneous": _fleet("homogeneous", (1, 1, 1, 1)),
    "gpu-cpu": Fleet("gpu-cpu", (
        Engine("gpu-1", fleet_a_engine("g1", 1.0, 16), capacity=16),
        Engine("gpu-2", fleet_a_engine("g2", 1.0, 16), capacity=16),
        Engine("cpu-1", fleet_a_engine("c1", 0.25, 4), capacity=4),
        Engine("cpu-2", fleet_a_engine("c2", 0.25, 4), capacity=4),
        Engine("cpu-3", fleet_a_engine("c3", 0.25, 4), capacity=4),
        Engine("cpu-4", fleet_a_engine("c4", 0.25, 4), capacity=4)), note="GPU tier + 4x slower CPU tier"),
    "slowing": Fleet("slowing", tuple(
        Engine(f"e{i}", fleet_a_engine(f"e{i}", 1.0, 8, **({"slow_to": 0.3, "slow_after": 15.0} if i == 0 else {})),
               capacity=8) for i in range(4)), note="e0 drops to 30 % of its speed after 15 s"),
}


def _mixed(name: str, specs, **kw) -> Fleet:
    """specs: (speed, max_seqs, batch_alpha, step_ms, prefill_ms_per_token, capacity)."""
    engines = tuple(Engine(f"e{i}", SimConfig(max_seqs=m, step_ms=st, batch_alpha=a, prefill_ms_per_token=pf, speed=s),
                           capacity=cap) for i, (s, m, a, st, pf, cap) in enumerate(specs))
    return Fleet(name, engines, **kw)


# Fleets the policy was NOT designed on: other speed ratios, slot counts, penalties, length
# distributions, failures, 2 and 8 engines, several gateways, capacities missing or wrong.
HELD_OUT = {
    "two-uneven": _mixed("two-uneven", [(1.0, 6, 0.15, 12, 0.05, 6), (0.35, 6, 0.15, 12, 0.05, 6)],
                         prompt=Dist("uniform", 50, 2000), output=Dist("uniform", 16, 256)),
    "eight-mixed": _mixed("eight-mixed", [(1.0, 16, 0.05, 15, 0.02, 16), (1.0, 16, 0.05, 15, 0.02, 16),
                                          (0.8, 8, 0.05, 15, 0.02, 8), (0.6, 8, 0.05, 15, 0.02, 8),
                                          (0.5, 8, 0.05, 15, 0.02, 8), (0.3, 4, 0.05, 15, 0.02, 4),
                                          (0.3, 4, 0.05, 15, 0.02, 4), (0.15, 2, 0.05, 15, 0.02, 2)],
                          prompt=Dist("lognormal", 300, 0.8, 4000), output=Dist("lognormal", 80, 0.7, 1000)),
    "heavy-tail": _fleet("heavy-tail", (1, 1, 0.5, 0.5), output=Dist("pareto", 30, 1.6, 2000),
                         note="Pareto output lengths"),
    "flat-batching": _mixed("flat-batching", [(1.0, 8, 0.0, 20, 0.1, 8), (0.5, 8, 0.0, 20, 0.1, 8),
                                              (0.5, 8, 0.0, 20, 0.1, 8), (0.25, 8, 0.0, 20, 0.1, 8)],
                            output=Dist("uniform", 20, 60)),
    "steep-penalty": _mixed("steep-penalty", [(1.0, 16, 0.3, 8, 0.02, 16), (1.0, 16, 0.3, 8, 0.02, 16),
                                              (0.25, 16, 0.3, 8, 0.02, 16)], output=Dist("const", 128)),
    "prefill-heavy": _mixed("prefill-heavy", [(1.0, 8, 0.1, 10, 0.1, 8), (0.5, 8, 0.1, 10, 0.1, 8),
                                              (0.5, 8, 0.1, 10, 0.1, 8)],
                            prompt=Dist("uniform", 2000, 8000), output=Dist("const", 32)),
    "failing": Fleet("failing", tuple(
        Engine(f"e{i}", fleet_a_engine(f"e{i}", s, 8), capacity=8, fail_at=20.0 if i == 1 else None)
        for i, s in enumerate((1, 1, 0.5, 0.5)))),
    "two-gateways": _fleet("two-gateways", (1, 1, 0.5, 0.25), gateways=2),
    "no-capacity": _fleet("no-capacity", (1, 0.7, 0.4, 0.2), capacity=False, output=Dist("uniform", 32, 96)),
    "capacity-too-high": Fleet("capacity-too-high", tuple(
        Engine(f"e{i}", fleet_a_engine(f"e{i}", s, 8), capacity=16) for i, s in enumerate((1, 1, 0.5, 0.25)))),
    "usage-reported": _fleet("usage-reported", (1, 0.6, 0.6, 0.3), usage=True, output=Dist("lognormal", 64, 0.9, 800)),
}


# bench/prefix.py's fleets and its default traffic, replayed here (`--workload prefix`): 80
# conversations started at 2 a second, a fifth of the requests one-shot, every request counted from
# cold caches (no warm-up), so its figures sit beside bench/prefix.py's.
PREFIX_CONVERSATIONS, PREFIX_RATE = 80, 2.0
PREFIX_LOAD = Load("prefix", 0.0, seconds=PREFIX_CONVERSATIONS / PREFIX_RATE, warmup=0.0)


def prefix_engines(uneven: bool) -> tuple[Engine, ...]:
    """Four engines with a prefix cache; KV for a few dozen conversations each, so the cache evicts."""
    speeds = (2.0, 1.0, 1.0, 0.5) if uneven else (1.0, 1.0, 1.0, 1.0)
    return tuple(Engine(f"e{i}", SimConfig(max_seqs=8, kv_tokens=24576, step_ms=20.0, batch_alpha=0.08,
                                           prefill_ms_per_token=0.25, speed=s), capacity=8)
                 for i, s in enumerate(speeds))


def prefix_fleets() -> dict[str, Fleet]:
    return {"prefix-bench": Fleet("prefix-bench", prefix_engines(False), note="bench/prefix.py's 4 engines"),
            "prefix-uneven": Fleet("prefix-uneven", prefix_engines(True), note="bench/prefix.py --uneven")}
