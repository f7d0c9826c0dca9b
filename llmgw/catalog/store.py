"""The applied catalog in Redis: versioned, hashed, replaced atomically by compare-and-set.

`keys.CATALOG` holds the current document {"version", "hash", "spec", "applied_at", "applied_by",
"source"}; `keys.CATALOG_HISTORY` keeps the last HISTORY_LIMIT documents, newest first. Versions only
grow; applying content whose hash equals the applied one writes nothing.
"""

from __future__ import annotations

import json
import time

import redis
from pydantic import ValidationError

from llmgw.catalog.types import Catalog
from llmgw.catalog.validate import pydantic_problems
from llmgw.errors import CatalogConflict, CatalogInvalid
from llmgw.state import keys
from llmgw.state.store import Store

HISTORY_LIMIT = 50


def _catalog_from_doc(doc: dict, where: str) -> Catalog:
    # The stored spec was validated when applied and is fully resolved; only its structure is checked
    # again, so a rule tightened in a later release never makes the running catalog unreadable.
    try:
        return Catalog.model_validate(doc["spec"])
    except ValidationError as e:
        raise CatalogInvalid(where, pydantic_problems(e, "", "catalog")) from e


def _meta(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "spec"}


def client_of(r: redis.Redis | Store) -> redis.Redis:
    """The catalog's functions take a `Store` (how the parts reach Redis) or a bare client (the CLI's)."""
    return r.r if isinstance(r, Store) else r


def catalog_applied(r: redis.Redis | Store) -> bool:
    """Whether any catalog was ever applied to this Redis (one EXISTS)."""
    return bool(client_of(r).exists(keys.CATALOG))


def read_applied(r: redis.Redis | Store) -> tuple[int, Catalog | None, dict]:
    """(version, catalog, metadata); version 0 and None when nothing was ever applied."""
    raw = client_of(r).get(keys.CATALOG)
    if not raw:
        return 0, None, {}
    doc = json.loads(raw)
    return int(doc["version"]), _catalog_from_doc(doc, "redis:" + keys.CATALOG), _meta(doc)


def applied_stamp(r: redis.Redis | Store) -> tuple[int, str] | None:
    """(version, hash) of the applied document without validating its spec; None when none was ever
    applied. Raises ValueError when the document is not JSON."""
    raw = client_of(r).get(keys.CATALOG)
    if not raw:
        return None
    doc = json.loads(raw)
    return doc.get("version"), doc.get("hash")


def applied_version(r: redis.Redis | Store) -> int:
    """The applied version (0 when none), without validating the spec."""
    raw = client_of(r).get(keys.CATALOG)
    return int(json.loads(raw)["version"]) if raw else 0


def catalog_names(r: redis.Redis | Store) -> set[str]:
    """Every model name and alias of the applied catalog (empty when none), without validating the
    spec: cheap enough for the gateway to call on each endpoint-list reload."""
    raw = client_of(r).get(keys.CATALOG)
    names: set[str] = set()
    if not raw:
        return names
    try:
        for m in (json.loads(raw).get("spec") or {}).get("models") or []:
            if isinstance(m, dict):
                names.add(m.get("name") or "")
                names.update(a for a in (m.get("aliases") or []) if isinstance(a, str))
    except (ValueError, AttributeError, TypeError):
        pass  # a malformed document names nothing; read_applied reports it
    names.discard("")
    return names


def history(r: redis.Redis | Store, n: int = 10) -> list[dict]:
    """Metadata of the last `n` applied versions, newest first: version, hash, applied_at/by, source,
    plus `models` and `replicas` counts."""
    out = []
    for raw in client_of(r).lrange(keys.CATALOG_HISTORY, 0, max(0, n - 1)) if n > 0 else []:
        doc = json.loads(raw)
        spec = doc.get("spec") or {}
        models = spec.get("models", [])
        meta = _meta(doc)
        meta["models"] = len(models)
        meta["replicas"] = sum(p.get("replicas", 0) for m in models for p in m.get("profiles", []))
        out.append(meta)
    return out


def read_version(r: redis.Redis | Store, version: int) -> tuple[Catalog, dict] | None:
    """A past version still kept in the history (the last HISTORY_LIMIT), or None."""
    for raw in client_of(r).lrange(keys.CATALOG_HISTORY, 0, -1):
        doc = json.loads(raw)
        if int(doc["version"]) == version:
            return _catalog_from_doc(doc, f"redis:{keys.CATALOG_HISTORY}[v{version}]"), _meta(doc)
    return None


def apply_catalog(
    r: redis.Redis | Store,
    catalog: Catalog,
    *,
    source: str,
    applied_by: str,
    expected_version: int | None = None,
    now: float | None = None,
) -> tuple[int, bool]:
    """Store `catalog` as the next version. Returns (version, changed).

    Applying a catalog whose hash equals the applied one changes nothing (no new version), even if
    another version was applied since `expected_version`: the result is already what was asked for.
    Otherwise, with `expected_version`, fails with CatalogConflict (writing nothing) if the applied
    version is no longer that one. The read, check and write are one WATCH/MULTI transaction.
    """
    now = time.time() if now is None else now
    digest = catalog.hash()
    spec = catalog.canonical()

    def txn(pipe: redis.client.Pipeline) -> tuple[int, bool]:
        raw = pipe.get(keys.CATALOG)
        current = json.loads(raw) if raw else {"version": 0, "hash": None}
        if current.get("hash") == digest:
            pipe.multi()
            return int(current["version"]), False
        if expected_version is not None and int(current["version"]) != expected_version:
            raise CatalogConflict(expected_version, int(current["version"]))
        version = int(current["version"]) + 1
        doc = {
            "version": version,
            "hash": digest,
            "spec": spec,
            "applied_at": now,
            "applied_by": applied_by,
            "source": source,
        }
        blob = json.dumps(doc, sort_keys=True)
        pipe.multi()
        pipe.set(keys.CATALOG, blob)
        pipe.lpush(keys.CATALOG_HISTORY, blob)
        pipe.ltrim(keys.CATALOG_HISTORY, 0, HISTORY_LIMIT - 1)
        return version, True

    return client_of(r).transaction(txn, keys.CATALOG, value_from_callable=True)
