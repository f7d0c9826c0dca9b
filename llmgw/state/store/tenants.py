"""The service every gateway process counted per key and model, for fair queueing and for the views
of it (`llmgw usage`, the console): one hash of totals per model and one per model and minute (the
record types and their encoding: llmgw.state.tenants)."""

from __future__ import annotations

from typing import Iterable, Mapping

from llmgw.state import keys
from llmgw.state.store.base import Aggregate, ms
from llmgw.state.tenants import TenantDelta, TenantTotals, field, parse_totals


class Tenants(Aggregate):
    def add_tenants(self, batch: Mapping[tuple[str, str], TenantDelta], minute: int,
                    read: Iterable[str] = ()) -> dict[str, dict[str, TenantTotals]]:
        """Add one process's counts, (model, key id) -> TenantDelta, to the models' totals and to this
        minute's service, then read the totals of the models in `read`, all in one round trip (what
        every process flushed so far, these counts included)."""
        read = sorted(set(read))
        pipe = self.r.pipeline(transaction=False)
        touched = set()
        for (model, kid), d in batch.items():
            h = keys.tenants(model)
            touched.add(model)
            if d.service:
                pipe.hincrbyfloat(h, field("n", kid), d.service)
            if d.tokens:
                pipe.hincrbyfloat(h, field("t", kid), d.tokens)
                m = keys.tenants_minute(model, minute)
                pipe.hincrbyfloat(m, kid, d.tokens)
                pipe.expire(m, keys.TENANTS_MINUTES * 60)
            if d.wait:
                pipe.hincrbyfloat(h, field("w", kid), d.wait)
            if d.requests:
                pipe.hincrby(h, field("r", kid), d.requests)
        for model in touched:
            pipe.pexpire(keys.tenants(model), ms(keys.TENANTS_KEEP))
        for model in read:
            pipe.hgetall(keys.tenants(model))
        out = pipe.execute()
        got = out[len(out) - len(read):] if read else []
        return {model: parse_totals(raw) for model, raw in zip(read, got)}

    def tenant_totals(self) -> dict[str, dict[str, TenantTotals]]:
        """Every model's totals per key (the models found by their hashes; model names hold no colon,
        so `<model>:m<minute>` is a minute's)."""
        prefix = keys.tenants("")
        models = sorted({k[len(prefix):] for k in self.r.scan_iter(match=prefix + "*", count=500)
                         if ":" not in k[len(prefix):]})
        pipe = self.r.pipeline(transaction=False)
        for model in models:
            pipe.hgetall(keys.tenants(model))
        return {m: parse_totals(raw) for m, raw in zip(models, pipe.execute())}

    def tenant_minutes(self, models: Iterable[str], minutes: Iterable[int]) -> dict[str, dict[int, dict[str, str]]]:
        """Per model, the per-minute service hashes of `minutes` (absent ones empty)."""
        models, minutes = list(models), list(minutes)
        pipe = self.r.pipeline(transaction=False)
        for model in models:
            for m in minutes:
                pipe.hgetall(keys.tenants_minute(model, m))
        got = iter(pipe.execute())
        return {model: {m: next(got) for m in minutes} for model in models}

