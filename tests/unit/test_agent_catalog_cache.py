"""The agent's cached catalog is read again at once when a record names what the copy lacks: a model,
a profile, or a LoRA adapter just applied (else the agent would call a freshly added adapter
undeclared and back off, for as long as the cache lives)."""

from __future__ import annotations

import fakeredis

from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store
from tests.support.clock import FakeClock
from workers.agent.launch import CatalogCache


def doc(*adapters: str) -> dict:
    return {"models": [{"name": "base", "profiles": [{"name": "p", "engine": "sim", "lora": {"max_loras": 2}}],
                        "adapters": [{"name": a, "source": f"/adapters/{a}", "rank": 8} for a in adapters]}]}


def test_an_adapter_applied_after_the_copy_was_read_is_found_without_waiting_for_the_ttl():
    store, clock = Store(fakeredis.FakeRedis(decode_responses=True)), FakeClock()
    apply_catalog(store, parse_catalog(doc("a1")), source="t", applied_by="t")
    cache = CatalogCache(store, clock, ttl=3600)
    rec = ReplicaRecord(id="r", model="base", profile="p", adapters_wanted=["a1"])
    assert cache.lookup(rec)[0].adapter("a1")
    apply_catalog(store, parse_catalog(doc("a1", "a2")), source="t", applied_by="t")
    clock.advance(0.1)
    wanted = ReplicaRecord(id="r", model="base", profile="p", adapters_wanted=["a1", "a2"])
    model, _ = cache.lookup(wanted)
    assert model.adapter("a2") is not None
    # What the copy holds is not read again for a record it answers.
    before = cache.fetched
    clock.advance(0.1)
    cache.lookup(rec)
    assert cache.fetched == before
