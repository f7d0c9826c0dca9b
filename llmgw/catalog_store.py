"""The applied catalog in Redis: versioned, hashed, replaced atomically by compare-and-set.

(Draft: diff, history and the CLI are filled in by the catalog work; these signatures are stable.)
"""

from __future__ import annotations

import json
import time

import redis

from llmgw import keys
from llmgw.catalog import Catalog, parse_catalog
from llmgw.errors import CatalogConflict


def read_applied(r: redis.Redis) -> tuple[int, Catalog | None, dict]:
    """(version, catalog, metadata); version 0 and None when nothing was ever applied."""
    raw = r.get(keys.CATALOG)
    if not raw:
        return 0, None, {}
    doc = json.loads(raw)
    meta = {k: v for k, v in doc.items() if k != "spec"}
    return int(doc["version"]), parse_catalog(doc["spec"], "redis:" + keys.CATALOG), meta


def apply_catalog(
    r: redis.Redis,
    catalog: Catalog,
    *,
    source: str,
    applied_by: str,
    expected_version: int | None = None,
    now: float | None = None,
) -> tuple[int, bool]:
    """Store `catalog` as the next version. Returns (version, changed).

    Applying a catalog whose hash equals the applied one changes nothing (no new version). With
    `expected_version`, fails with CatalogConflict if someone applied another version in between.
    """
    now = time.time() if now is None else now
    digest = catalog.hash()

    def txn(pipe: redis.client.Pipeline) -> tuple[int, bool]:
        raw = pipe.get(keys.CATALOG)
        current = json.loads(raw) if raw else {"version": 0, "hash": None}
        if expected_version is not None and current["version"] != expected_version:
            raise CatalogConflict(expected_version, current["version"])
        if current.get("hash") == digest:
            pipe.multi()
            return current["version"], False
        version = current["version"] + 1
        doc = {
            "version": version,
            "hash": digest,
            "spec": catalog.canonical(),
            "applied_at": now,
            "applied_by": applied_by,
            "source": source,
        }
        pipe.multi()
        pipe.set(keys.CATALOG, json.dumps(doc))
        pipe.lpush(keys.CATALOG_HISTORY, json.dumps(doc))
        pipe.ltrim(keys.CATALOG_HISTORY, 0, 49)
        return version, True

    return r.transaction(txn, keys.CATALOG, value_from_callable=True)
