"""The applied catalog in Redis (fakeredis): versions, unchanged content, compare-and-set, history."""

from __future__ import annotations

import json

import pytest

from llmgw.catalog import HISTORY_LIMIT, apply_catalog, parse_catalog_text, read_applied, read_version
from llmgw.errors import CatalogConflict
from llmgw.state import keys


def cat(replicas: int = 1, name: str = "m"):
    return parse_catalog_text(f"models:\n  - {{name: {name}, profiles: [{{name: s, engine: sim, replicas: {replicas}}}]}}\n")


def test_nothing_applied(store):
    assert read_applied(store) == (0, None, {})
    assert store.catalog_version() == 0 and store.catalog_history() == [] and read_version(store, 1) is None


def test_apply_read_and_same_content_again(store):
    assert apply_catalog(store, cat(1), source="a.yaml", applied_by="alice", now=100.0) == (1, True)
    version, got, meta = read_applied(store)
    assert version == 1 and got == cat(1)
    assert meta == {"version": 1, "hash": cat(1).hash(), "applied_at": 100.0, "applied_by": "alice", "source": "a.yaml"}
    assert apply_catalog(store, cat(1), source="a.yaml", applied_by="bob", now=200.0) == (1, False)
    assert read_applied(store).meta["applied_by"] == "alice" and store.r.llen(keys.CATALOG_HISTORY) == 1
    assert apply_catalog(store, cat(2), source="a.yaml", applied_by="bob", now=300.0) == (2, True)
    assert store.catalog_version() == 2


def test_compare_and_set(store):
    apply_catalog(store, cat(1), source="a", applied_by="x")
    apply_catalog(store, cat(2), source="a", applied_by="y")  # someone else moves to version 2
    before = (store.r.get(keys.CATALOG), store.r.lrange(keys.CATALOG_HISTORY, 0, -1))
    with pytest.raises(CatalogConflict) as exc:
        apply_catalog(store, cat(3), source="a", applied_by="x", expected_version=1)
    assert (exc.value.expected, exc.value.actual) == (1, 2)
    assert (store.r.get(keys.CATALOG), store.r.lrange(keys.CATALOG_HISTORY, 0, -1)) == before
    assert apply_catalog(store, cat(3), source="a", applied_by="x", expected_version=2) == (3, True)
    # the content already applied is not a conflict: the result is what was asked for
    assert apply_catalog(store, cat(3), source="a", applied_by="z", expected_version=1) == (3, False)


def test_history_newest_first_with_counts_and_bounded(store):
    for i in range(HISTORY_LIMIT + 5):
        apply_catalog(store, cat(i), source=f"v{i}", applied_by="ops", now=float(i))
    items = store.catalog_history(3)
    assert [it["version"] for it in items] == [HISTORY_LIMIT + 5, HISTORY_LIMIT + 4, HISTORY_LIMIT + 3]
    assert items[0]["replicas"] == HISTORY_LIMIT + 4 and items[0]["models"] == 1 and "spec" not in items[0]
    assert store.r.llen(keys.CATALOG_HISTORY) == HISTORY_LIMIT
    found = read_version(store, HISTORY_LIMIT + 4)
    assert found is not None and found[0] == cat(HISTORY_LIMIT + 3)
    assert read_version(store, 1) is None  # trimmed
    assert store.catalog_history(0) == []


def test_stored_spec_is_resolved_json(store):
    apply_catalog(store, cat(1), source="a", applied_by="x")
    spec = json.loads(store.r.get(keys.CATALOG))["spec"]
    assert spec["models"][0]["profiles"][0]["capacity"] == 16  # engine defaults are baked in
