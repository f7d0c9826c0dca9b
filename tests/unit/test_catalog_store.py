"""The applied catalog in Redis (fakeredis): versions, unchanged content, compare-and-set, history."""

from __future__ import annotations

import json

import fakeredis
import pytest

from llmgw.catalog import (
    HISTORY_LIMIT,
    applied_version,
    apply_catalog,
    history,
    parse_catalog_text,
    read_applied,
    read_version,
)
from llmgw.errors import CatalogConflict
from llmgw.state import keys


def cat(replicas: int = 1, name: str = "m"):
    return parse_catalog_text(f"models:\n  - {{name: {name}, profiles: [{{name: s, engine: sim, replicas: {replicas}}}]}}\n")


@pytest.fixture
def r():
    return fakeredis.FakeRedis(decode_responses=True)


def test_nothing_applied(r):
    assert read_applied(r) == (0, None, {})
    assert applied_version(r) == 0 and history(r) == [] and read_version(r, 1) is None


def test_apply_read_and_same_content_again(r):
    assert apply_catalog(r, cat(1), source="a.yaml", applied_by="alice", now=100.0) == (1, True)
    version, got, meta = read_applied(r)
    assert version == 1 and got == cat(1)
    assert meta == {"version": 1, "hash": cat(1).hash(), "applied_at": 100.0, "applied_by": "alice", "source": "a.yaml"}
    assert apply_catalog(r, cat(1), source="a.yaml", applied_by="bob", now=200.0) == (1, False)
    assert read_applied(r)[2]["applied_by"] == "alice" and r.llen(keys.CATALOG_HISTORY) == 1
    assert apply_catalog(r, cat(2), source="a.yaml", applied_by="bob", now=300.0) == (2, True)
    assert applied_version(r) == 2


def test_compare_and_set(r):
    apply_catalog(r, cat(1), source="a", applied_by="x")
    apply_catalog(r, cat(2), source="a", applied_by="y")  # someone else moves to version 2
    before = (r.get(keys.CATALOG), r.lrange(keys.CATALOG_HISTORY, 0, -1))
    with pytest.raises(CatalogConflict) as exc:
        apply_catalog(r, cat(3), source="a", applied_by="x", expected_version=1)
    assert (exc.value.expected, exc.value.actual) == (1, 2)
    assert (r.get(keys.CATALOG), r.lrange(keys.CATALOG_HISTORY, 0, -1)) == before
    assert apply_catalog(r, cat(3), source="a", applied_by="x", expected_version=2) == (3, True)
    # the content already applied is not a conflict: the result is what was asked for
    assert apply_catalog(r, cat(3), source="a", applied_by="z", expected_version=1) == (3, False)


def test_history_newest_first_with_counts_and_bounded(r):
    for i in range(HISTORY_LIMIT + 5):
        apply_catalog(r, cat(i), source=f"v{i}", applied_by="ops", now=float(i))
    items = history(r, 3)
    assert [it["version"] for it in items] == [HISTORY_LIMIT + 5, HISTORY_LIMIT + 4, HISTORY_LIMIT + 3]
    assert items[0]["replicas"] == HISTORY_LIMIT + 4 and items[0]["models"] == 1 and "spec" not in items[0]
    assert r.llen(keys.CATALOG_HISTORY) == HISTORY_LIMIT
    found = read_version(r, HISTORY_LIMIT + 4)
    assert found is not None and found[0] == cat(HISTORY_LIMIT + 3)
    assert read_version(r, 1) is None  # trimmed
    assert history(r, 0) == []


def test_stored_spec_is_resolved_json(r):
    apply_catalog(r, cat(1), source="a", applied_by="x")
    spec = json.loads(r.get(keys.CATALOG))["spec"]
    assert spec["models"][0]["profiles"][0]["capacity"] == 16  # engine defaults are baked in
