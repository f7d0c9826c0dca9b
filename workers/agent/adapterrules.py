"""What a node agent does about a replica's LoRA adapters: pure functions over (its record, what this
agent remembers of the attempt, the answers of its engine since the last pass, now).

An engine that loads adapters at run time (vLLM, the sim) is first asked what it holds (`GET
/v1/models`: after a restart it holds nothing, an adopted one may hold some), then each adapter
the record wants and the engine lacks is loaded, one call per adapter, unless its last load failed
and the backoff the reconciler also reads (`workers.control.adapterplacement.Backoff`) has not ended. An
adapter it holds that is no longer wanted is unloaded once it has been unwanted for `grace` seconds
(the publisher dropped it at once: every gateway has moved on by then) and the engine runs and
queues no request for it. Where adapters are part of the launch (llama.cpp) the engine holds its
launch set once Ready. Every step returns the record's adapter fields to write (all of them, when
any changed), the calls to make, and what to tell the event history.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, NamedTuple

from llmgw.engines.base import AdapterCall, EngineDriver
from llmgw.state.records import ReplicaRecord
from workers.control.adapterplacement import Backoff, LoadFailure

UNLOAD_GRACE = 5.0  # seconds an adapter stays loaded after it stopped being wanted


@dataclass(frozen=True)
class Job:
    """One call to a replica's engine: ask what it holds (`sync`), load or unload an adapter."""

    replica_id: str
    attempt: int
    kind: str  # "sync" | "load" | "unload"
    adapter: str = ""
    call: AdapterCall | None = None


@dataclass(frozen=True)
class Result:
    """A job's answer: done or not (and why), and for a sync the adapters the engine listed."""

    replica_id: str
    attempt: int
    kind: str
    adapter: str = ""
    done: bool = False
    reason: str = ""
    held: tuple[str, ...] = ()


@dataclass(frozen=True)
class Memory:
    """What this agent knows of one attempt's adapters beyond its record: whether the engine was asked
    what it holds (and is being asked), the adapters with a call in flight, and since when each held
    adapter is unwanted."""

    attempt: int
    synced: bool = False
    syncing: bool = False
    busy: frozenset[str] = frozenset()
    unwanted_since: Mapping[str, float] = field(default_factory=dict)


class AdapterEvent(NamedTuple):
    """An event for the history about one adapter of a replica (`adapter_loaded`, ...)."""

    kind: str
    adapter: str
    message: str


@dataclass(frozen=True)
class Step:
    fields: Mapping[str, object]  # the record's adapter fields (empty: nothing changed)
    jobs: tuple[Job, ...] = ()
    memory: Memory | None = None
    news: tuple[AdapterEvent, ...] = ()


def launch_step(rec: ReplicaRecord) -> Step:
    """A Ready replica whose adapters are part of its launch holds the set it was launched with."""
    if rec.adapters_attempt == rec.attempt and rec.adapters_held == rec.adapters_wanted and not rec.adapters_loading:
        return Step({})
    return Step({"adapters_held": list(rec.adapters_wanted), "adapters_loading": [], "adapters_attempt": rec.attempt})


def _failure(failures: dict, rid: str, adapter: str, reason: str, now: float, backoff: Backoff) -> dict:
    """`failures` with one more failed load of `adapter`, and when it is tried again (for status)."""
    prev = failures.get(adapter)
    attempts = int(prev.get("attempts") or 0) + 1 if isinstance(prev, dict) else 1
    retry_at = backoff.retry_at(LoadFailure(rid, adapter, reason, now, attempts))
    return {**failures, adapter: {"reason": reason, "at": now, "attempts": attempts, "retry_at": retry_at}}


def _blocked(failures: Mapping, rid: str, adapter: str, now: float, backoff: Backoff) -> bool:
    f = failures.get(adapter)
    if not isinstance(f, dict):
        return False
    failure = LoadFailure(rid, adapter, str(f.get("reason") or ""), float(f.get("at") or 0.0), int(f.get("attempts") or 1))
    return now < backoff.retry_at(failure)


def runtime_step(rec: ReplicaRecord, memory: Memory | None, results: Iterable[Result], engine: EngineDriver,
                 paths: Mapping[str, str], unresolved: Mapping[str, str], active: frozenset[str], now: float,
                 backoff: Backoff = Backoff(), grace: float = UNLOAD_GRACE) -> Step:
    """One pass over a Ready replica of an engine that loads adapters at run time. `paths`: where
    each wanted adapter is on this node; `unresolved`: why one is not (recorded as a failed load);
    `active`: adapters the engine runs or queues requests for, by its last scrape."""
    mem = memory if memory is not None and memory.attempt == rec.attempt else Memory(rec.attempt)
    current = rec.adapters_attempt == rec.attempt
    held = list(rec.holds)
    loading = set(rec.adapters_loading) if current else set()
    failures = dict(rec.adapter_failures or {})
    busy, synced, syncing = set(mem.busy), mem.synced, mem.syncing
    news: list[AdapterEvent] = []
    for r in results:
        if r.replica_id != rec.id or r.attempt != rec.attempt:
            continue
        if r.kind == "sync":
            syncing = False
            if r.done:
                synced, held, loading = True, list(r.held), set()
            continue
        busy.discard(r.adapter)
        loading.discard(r.adapter)
        if r.kind == "load" and r.done:
            held = held if r.adapter in held else [*held, r.adapter]
            failures.pop(r.adapter, None)
            news.append(AdapterEvent("adapter_loaded", r.adapter, f"adapter {r.adapter} loaded"))
        elif r.kind == "load":
            failures = _failure(failures, rec.id, r.adapter, r.reason, now, backoff)
            news.append(AdapterEvent("adapter_load_failed", r.adapter, f"loading adapter {r.adapter} failed "
                                     f"({failures[r.adapter]['attempts']}x): {r.reason}"))
        elif r.done:
            held = [a for a in held if a != r.adapter]
            news.append(AdapterEvent("adapter_unloaded", r.adapter, f"adapter {r.adapter} unloaded: no longer wanted here"))
    jobs: list[Job] = []
    since: dict[str, float] = {}
    if not synced and not syncing:
        jobs.append(Job(rec.id, rec.attempt, "sync"))
        syncing = True
    if synced:
        for a in rec.adapters_wanted:
            if a in held or a in busy or _blocked(failures, rec.id, a, now, backoff):
                continue
            if a in unresolved or a not in paths:
                failures = _failure(failures, rec.id, a, unresolved.get(a, "its source is not on this node"), now, backoff)
                news.append(AdapterEvent("adapter_load_failed", a, f"adapter {a} cannot be loaded: {failures[a]['reason']}"))
                continue
            call = engine.adapter_load_call(a, paths[a])
            if call is not None:
                jobs.append(Job(rec.id, rec.attempt, "load", a, call))
                busy.add(a)
                loading.add(a)
        for a in held:
            if a in rec.adapters_wanted:
                continue
            since[a] = mem.unwanted_since.get(a, now)
            if a not in busy and a not in active and now - since[a] >= grace:
                call = engine.adapter_unload_call(a)
                if call is not None:
                    jobs.append(Job(rec.id, rec.attempt, "unload", a, call))
                    busy.add(a)
    new = {"adapters_held": held, "adapters_loading": sorted(loading), "adapter_failures": failures,
           "adapters_attempt": rec.attempt if synced else rec.adapters_attempt}
    changed = any(getattr(rec, k) != v for k, v in new.items())
    memory_now = replace(mem, synced=synced, syncing=syncing, busy=frozenset(busy), unwanted_since=since)
    return Step(new if changed else {}, tuple(jobs), memory_now, tuple(news))


def listed_adapters(models_json: object) -> tuple[str, ...]:
    """The adapters a vLLM-style `GET /v1/models` lists: the cards with a `parent` (its base model)."""
    data = models_json.get("data") if isinstance(models_json, dict) else None
    if not isinstance(data, list):
        raise ValueError("the engine's /v1/models answer has no list of models")
    return tuple(c["id"] for c in data if isinstance(c, dict) and c.get("parent") and isinstance(c.get("id"), str))
