"""Autoscaling: the gateways' demand hints per model (a value with a TTL), the autoscaler's state per
profile (one hash), and each profile's recent samples (a sorted set by time, trimmed by age and count)."""

from __future__ import annotations

import json
from typing import Iterable, Iterator, Mapping, Sequence

from llmgw.state import keys
from llmgw.state.demand_records import DemandHint, ScaleState
from llmgw.state.store.base import Aggregate, Pipeline, compact, ms


def queue_hints(pipe: Pipeline, names: Sequence[str]) -> None:
    if names:
        pipe.mget([keys.demand_hint(m) for m in names])


def take_hints(names: Sequence[str], replies: Iterator) -> dict[str, DemandHint]:
    """The readable hints of `names` (a hint from a newer or broken writer says nothing)."""
    out = {}
    for m, raw in zip(names, next(replies) if names else []):
        if raw:
            try:
                out[m] = DemandHint.from_dict(json.loads(raw))
            except (ValueError, TypeError):
                continue
    return out


def queue_states(pipe: Pipeline) -> None:
    pipe.hgetall(keys.AUTOSCALE)


def take_states(replies: Iterator) -> dict[tuple[str, str], ScaleState]:
    """(model, profile) -> the autoscaler's record; unreadable entries are skipped."""
    out = {}
    for f, raw in next(replies).items():
        model, _, profile = f.rpartition("/")
        try:
            out[(model, profile)] = ScaleState.from_dict(json.loads(raw))
        except (ValueError, TypeError):
            continue
    return out


def queue_histories(pipe: Pipeline, since: Mapping[tuple[str, str], float]) -> None:
    """Each profile of `since` (in its order): its samples from `since[profile]` on."""
    for (m, p), t in since.items():
        pipe.zrangebyscore(keys.autoscale_history(m, p), t, "+inf")


def take_histories(profiles: Iterable[tuple[str, str]], replies: Iterator) -> dict[tuple[str, str], list[list]]:
    """Each profile's samples (JSON lists), oldest first; unreadable ones are skipped."""
    out: dict[tuple[str, str], list[list]] = {}
    for key in profiles:
        rows = []
        for raw in next(replies):
            try:
                rows.append(json.loads(raw))
            except ValueError:
                continue
        out[key] = rows
    return out


class Autoscale(Aggregate):
    def write_demand_hint(self, model: str, hint: DemandHint, ttl: float) -> None:
        self.r.set(keys.demand_hint(model), json.dumps(hint.to_dict()), px=ms(ttl))

    def scale_states(self) -> dict[tuple[str, str], ScaleState]:
        """(model, profile) -> the autoscaler's record; unreadable entries are skipped."""
        return take_states(iter([self.r.hgetall(keys.AUTOSCALE)]))

    def write_scaling(self, states: Mapping[tuple[str, str], ScaleState],
                      samples: Mapping[tuple[str, str], tuple[float, list]],
                      keep_since: Mapping[tuple[str, str], float], keep_max: int,
                      forget: Iterable[tuple[str, str]] = ()) -> None:
        """One pipeline for a pass: each profile's state, its new sample (trimmed by age and count), and
        the records of profiles that no longer autoscale deleted."""
        pipe = self.r.pipeline(transaction=False)
        if states:
            pipe.hset(keys.AUTOSCALE, mapping={keys.autoscale_field(m, p): json.dumps(st.to_dict())
                                               for (m, p), st in states.items()})
        for (m, p), (t, row) in samples.items():
            h = keys.autoscale_history(m, p)
            pipe.zadd(h, {compact(row): t})
            pipe.zremrangebyscore(h, "-inf", f"({keep_since.get((m, p), float('-inf'))!r}")
            pipe.zremrangebyrank(h, 0, -(keep_max + 1))
        gone = list(forget)
        if gone:
            pipe.hdel(keys.AUTOSCALE, *(keys.autoscale_field(m, p) for m, p in gone))
            pipe.delete(*(keys.autoscale_history(m, p) for m, p in gone))
        pipe.execute()
