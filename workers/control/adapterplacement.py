"""Adapter placement: which replicas hold which LoRA adapters. Pure: no Redis, no clock.

`place_adapters(wants, replicas, demand, failures, now)` returns the set each replica should hold and
the actions that get there (`LoadAdapter`, `UnloadAdapter` on engines that load at run time,
`RelaunchWithAdapters` on those whose adapters are part of the launch), and the adapters it could not
place as many times as wanted, with why.

Rules (docs/catalog.md#adapters-lora): an adapter with `replicas: all` goes on every replica that serves it,
before anything else; one with `replicas: N` on N of them, spread over nodes first; with demand
known, each adapter's target is its share of all adapter slots by requests per second (at least one
replica while it is requested), so busier adapters get more replicas; such an extra replica is never
one whose adapters are part of its launch, unless it is about to be created (no replacement for
demand alone). A replica never holds more
than `max_loras`. What a replica holds stays where it is while it is still wanted (no churn when
nothing changed): an adapter above its target gives up a slot only when another adapter below its
own target needs it. A load that failed is not retried on that replica before its backoff ends;
meanwhile another replica may take the adapter, and the shortfall keeps the reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple

from llmgw.catalog.types import ADAPTERS_AT_LAUNCH, Model, Profile
from llmgw.state.records import ReplicaRecord


@dataclass(frozen=True)
class AdapterWant:
    """An adapter and how many replicas should hold it at least: N, or None for every replica that
    serves it (`replicas: all`)."""

    name: str
    replicas: int | None = 1


@dataclass(frozen=True)
class ReplicaSlots:
    """One replica as placement sees it: its adapter slots (`max_loras`), the adapters its profile
    serves, what it holds and is loading, whether it can take a load now (Ready), and whether its
    adapters are part of its launch (llama.cpp: a different set is a relaunch)."""

    replica_id: str
    node: str
    max_loras: int
    serves: frozenset[str]
    held: frozenset[str] = frozenset()
    loading: frozenset[str] = frozenset()
    ready: bool = True
    at_launch: bool = False
    # What it was told to hold and may not hold yet (its `adapters_wanted`): kept there, like what it
    # holds, unless a load failed there and its backoff has not ended.
    assigned: frozenset[str] = frozenset()
    # About to be created: its adapters are chosen now for free (where adapters are part of the launch,
    # changing those of an existing replica takes a replacement).
    fresh: bool = False


@dataclass(frozen=True)
class LoadFailure:
    """The last failed load of `adapter` on a replica: when, why, and how many in a row."""

    replica_id: str
    adapter: str
    reason: str
    at: float
    attempts: int = 1


@dataclass(frozen=True)
class Backoff:
    """Seconds until a failed load is tried again: base x 2^(attempts-1), at most `cap`."""

    base: float = 5.0
    cap: float = 300.0

    def retry_at(self, f: LoadFailure) -> float:
        return f.at + min(self.cap, self.base * 2 ** max(0, f.attempts - 1))


@dataclass(frozen=True)
class LoadAdapter:
    replica_id: str
    adapter: str
    attempt: int = 1  # 1 for a first load; n + 1 after n failures in a row


@dataclass(frozen=True)
class UnloadAdapter:
    replica_id: str
    adapter: str


@dataclass(frozen=True)
class RelaunchWithAdapters:
    """A replica whose adapters are part of its launch must be replaced to hold `adapters`."""

    replica_id: str
    adapters: tuple[str, ...]


Action = LoadAdapter | UnloadAdapter | RelaunchWithAdapters


@dataclass(frozen=True)
class Shortfall:
    adapter: str
    wanted: int
    placed: int
    reason: str


@dataclass(frozen=True)
class AdapterPlan:
    desired: Mapping[str, frozenset[str]]  # replica id -> the adapters it should hold
    actions: tuple[Action, ...]
    shortfalls: tuple[Shortfall, ...]

    def holders(self, adapter: str) -> tuple[str, ...]:
        return tuple(sorted(r for r, held in self.desired.items() if adapter in held))


def wants_for(model: Model) -> list[AdapterWant]:
    """The catalog's adapters of `model` as placement reads them."""
    return [AdapterWant(a.name, None if a.pinned else int(a.replicas)) for a in model.adapters]


class ProfileSlots(NamedTuple):
    """What each replica of a profile offers adapter placement: its slots (`max_loras`; 0: no
    `lora:`), the adapters it serves, and whether they are part of its launch (llama.cpp)."""

    max_loras: int
    serves: frozenset[str]
    at_launch: bool


def slots_for(model: Model, profile_name: str) -> ProfileSlots:
    """The adapter slots of one of `model`'s profiles."""
    p = model.profile(profile_name)
    if p is None or p.lora is None:
        return ProfileSlots(0, frozenset(), False)
    return ProfileSlots(p.lora.max_loras, frozenset(a.name for a in model.adapters_for(p)),
                        p.engine in ADAPTERS_AT_LAUNCH)


def published_adapters(rec: ReplicaRecord, model: Model, profile: Profile) -> tuple[str, ...]:
    """The adapters a Ready replica is published with: those its engine holds. Where adapters are
    part of the launch (llama.cpp) all of them, in id order (the positions are the ids a request's
    `lora` list names); elsewhere only those still wanted there and served by its profile, so an
    adapter about to be unloaded gets no new requests."""
    held = rec.holds
    if not held or profile.lora is None:
        return ()
    if profile.engine in ADAPTERS_AT_LAUNCH:
        return tuple(held)
    serves = {a.name for a in model.adapters_for(profile)}
    wanted = set(rec.adapters_wanted)
    return tuple(a for a in held if a in wanted and a in serves)


class _State:
    """The assignment being built, with the counts the rules read."""

    def __init__(self, replicas: list[ReplicaSlots]):
        self.replicas = replicas
        self.assigned: dict[str, set[str]] = {r.replica_id: set() for r in replicas}
        self.count: Counter[str] = Counter()
        self.on_node: Counter[tuple[str, str]] = Counter()

    def add(self, r: ReplicaSlots, a: str) -> None:
        self.assigned[r.replica_id].add(a)
        self.count[a] += 1
        self.on_node[(a, r.node)] += 1

    def remove(self, r: ReplicaSlots, a: str) -> None:
        self.assigned[r.replica_id].discard(a)
        self.count[a] -= 1
        self.on_node[(a, r.node)] -= 1

    def free(self, r: ReplicaSlots) -> int:
        return r.max_loras - len(self.assigned[r.replica_id])


def _targets(wants: list[AdapterWant], eligible: dict[str, list[ReplicaSlots]], total_slots: int,
             demand: Mapping[str, float]) -> tuple[dict[str, int], dict[str, int]]:
    """(floor, target) per adapter: the floor is `replicas` (all: every replica that serves it), and
    at least 1 while it is requested; the target adds the adapter's share of all slots by demand."""
    floors, targets = {}, {}
    total = sum(max(0.0, demand.get(w.name, 0.0)) for w in wants)
    for w in wants:
        n = len(eligible[w.name])
        d = max(0.0, demand.get(w.name, 0.0))
        floor = n if w.replicas is None else min(max(w.replicas, 1 if d > 0 else 0), n)
        share = max(1, int(total_slots * d / total)) if d > 0 else 0
        floors[w.name], targets[w.name] = floor, min(n, max(floor, share))
    return floors, targets


def place_adapters(wants: Iterable[AdapterWant], replicas: Iterable[ReplicaSlots],
                   demand: Mapping[str, float] | None = None, failures: Iterable[LoadFailure] = (),
                   now: float = 0.0, backoff: Backoff = Backoff()) -> AdapterPlan:
    """Decide which replica holds which adapter, and the actions from what they hold now."""
    wants = sorted(wants, key=lambda w: w.name)
    reps = sorted(replicas, key=lambda r: r.replica_id)
    demand = demand or {}
    failed = {(f.replica_id, f.adapter): f for f in failures}
    blocked = {k for k, f in failed.items() if backoff.retry_at(f) > now}
    eligible = {w.name: [r for r in reps if w.name in r.serves] for w in wants}
    floors, targets = _targets(wants, eligible, sum(r.max_loras for r in reps), demand)
    pinned = {w.name for w in wants if w.replicas is None}

    def rank(a: str) -> tuple:  # who keeps a slot first: pinned, then busier, then name
        return (a not in pinned, -demand.get(a, 0.0), a)

    st = _State(reps)
    for r in reps:  # pinned adapters first, then keep what is held (or loading) and still wanted, up to max_loras
        kept = {a for a in r.assigned if (r.replica_id, a) not in blocked}
        current = (r.held | r.loading | kept) & r.serves & set(targets)
        pins = {a for a in pinned & r.serves if (r.replica_id, a) not in blocked}
        # More than fit (an engine still holding what the last pass moved away): what that pass
        # assigned comes before what is only held, so the next pass does not undo it.
        first = sorted(current | pins, key=lambda a: (a not in pinned, a not in kept, rank(a)))
        for a in first[:max(0, r.max_loras)]:
            st.add(r, a)

    shortfalls = []
    for stage in (floors, targets):  # every floor before any demand extra
        for w in sorted(wants, key=lambda w: rank(w.name)):
            a = w.name
            while st.count[a] < stage[a] and _place_one(st, a, eligible[a], blocked, targets, rank,
                                                         extra=stage is targets):
                pass
            if stage is floors and st.count[a] < floors[a]:
                shortfalls.append(Shortfall(a, floors[a], st.count[a], _why(a, eligible[a], st, blocked, failed, backoff)))
    for w in wants:
        if not eligible[w.name] and (w.replicas is None or w.replicas > 0 or demand.get(w.name, 0) > 0):
            shortfalls.append(Shortfall(w.name, w.replicas or 0, 0, "no replica serves it (no replica of a profile "
                                                                     "with `lora:` that serves it is running)"))
    desired = {rid: frozenset(s) for rid, s in st.assigned.items()}
    return AdapterPlan(desired, tuple(_actions(reps, desired, failed)), tuple(shortfalls))


def _place_one(st: _State, a: str, eligible: list[ReplicaSlots], blocked: set, targets: dict[str, int],
               rank, extra: bool = False) -> bool:
    """Give adapter `a` one more replica: a free slot, else one taken from an adapter above its
    target. Nodes with fewer holders of `a` first, then those that need no replacement to take it,
    then Ready (or about to launch with it), then runtime loads, then more room. An `extra` replica
    (for demand, above the floor) never costs a replacement: a launched llama.cpp replica keeps its set."""
    candidates = [r for r in eligible if a not in st.assigned[r.replica_id] and (r.replica_id, a) not in blocked
                  and not (extra and r.at_launch and not r.fresh)]

    def order(r: ReplicaSlots) -> tuple:
        launched = r.at_launch and not r.fresh
        return (st.on_node[(a, r.node)], launched, not (r.ready or r.fresh and r.at_launch), r.at_launch,
                -st.free(r), r.replica_id)

    free = [r for r in candidates if st.free(r) > 0]
    if free:
        st.add(min(free, key=order), a)
        return True
    for r in sorted(candidates, key=order):
        surplus = [b for b in st.assigned[r.replica_id] if st.count[b] > targets.get(b, 0) and b != a]
        if surplus:
            victim = max(surplus, key=lambda b: (st.count[b] - targets.get(b, 0), rank(b)))
            st.remove(r, victim)
            st.add(r, a)
            return True
    return False


def _why(a: str, eligible: list[ReplicaSlots], st: _State, blocked: set, failed: dict, backoff: Backoff) -> str:
    """Why adapter `a` is on fewer replicas than its floor, for status and `llmgw explain`."""
    if not eligible:
        return "no replica serves it"
    waiting = [failed[(r.replica_id, a)] for r in eligible
               if (r.replica_id, a) in blocked and a not in st.assigned[r.replica_id]]
    if waiting:
        f = min(waiting, key=backoff.retry_at)
        return (f"loading it failed on {f.replica_id} ({f.attempts}x): {f.reason}; next try at "
                f"{backoff.retry_at(f):.0f}")
    return (f"every replica that serves it is full ({sum(r.max_loras for r in eligible)} adapter slots on "
            f"{len(eligible)} replicas, max_loras each)")


def _actions(reps: list[ReplicaSlots], desired: Mapping[str, frozenset[str]], failed: dict) -> list[Action]:
    """From what each Ready replica holds to what it should: loads and unloads at run time, a relaunch
    where adapters are part of the launch. A replica that is not Ready gets nothing yet."""
    out: list[Action] = []
    for r in reps:
        want = desired[r.replica_id]
        if not r.ready or r.fresh:
            continue
        if r.at_launch:
            if want != r.held:
                out.append(RelaunchWithAdapters(r.replica_id, tuple(sorted(want))))
            continue
        current = r.held | r.loading
        for a in sorted(want - current):
            f = failed.get((r.replica_id, a))
            out.append(LoadAdapter(r.replica_id, a, attempt=f.attempts + 1 if f else 1))
        out += [UnloadAdapter(r.replica_id, a) for a in sorted(current - want)]
    return out
