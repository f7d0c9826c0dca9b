"""Autoscaling: the gateways' demand hints per model (a value with a TTL), the autoscaler's state per
profile (one hash), and each profile's recent samples (a sorted set by time, trimmed by age and count)."""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from llmgw.state import keys
from llmgw.state.demand_records import DemandHint, ScaleState
from llmgw.state.store.base import Aggregate, compact, ms


class Autoscale(Aggregate):
    def write_demand_hint(self, model: str, hint: DemandHint, ttl: float) -> None:
        self.r.set(keys.demand_hint(model), json.dumps(hint.to_dict()), px=ms(ttl))

    def demand_hints(self, models: Iterable[str]) -> dict[str, DemandHint]:
        models = list(models)
        if not models:
            return {}
        out = {}
        for m, raw in zip(models, self.r.mget([keys.demand_hint(m) for m in models])):
            if raw:
                try:
                    out[m] = DemandHint.from_dict(json.loads(raw))
                except (ValueError, TypeError):
                    continue  # a hint from a newer or broken writer says nothing
        return out

    def scale_states(self) -> dict[tuple[str, str], ScaleState]:
        """(model, profile) -> the autoscaler's record; unreadable entries are skipped."""
        out = {}
        for f, raw in self.r.hgetall(keys.AUTOSCALE).items():
            model, _, profile = f.rpartition("/")
            try:
                out[(model, profile)] = ScaleState.from_dict(json.loads(raw))
            except (ValueError, TypeError):
                continue
        return out

    def scale_histories(self, profiles: Iterable[tuple[str, str]], since: Mapping[tuple[str, str], float]
                        ) -> dict[tuple[str, str], list[list]]:
        """Each profile's samples (JSON lists) from `since[profile]` on, oldest first, in one round trip."""
        profiles = list(profiles)
        pipe = self.r.pipeline(transaction=False)
        for m, p in profiles:
            pipe.zrangebyscore(keys.autoscale_history(m, p), since.get((m, p), "-inf"), "+inf")
        out: dict[tuple[str, str], list[list]] = {}
        for key, members in zip(profiles, pipe.execute()):
            rows = []
            for raw in members:
                try:
                    rows.append(json.loads(raw))
                except ValueError:
                    continue
            out[key] = rows
        return out

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
