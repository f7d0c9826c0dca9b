"""The applied catalog as a `Catalog`: reading a stored document back, and applying the next version.

The documents themselves (versioned, hashed, replaced by compare-and-set) are the store's
(`llmgw.state.store.catalog`); here they are turned into catalogs and back.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

from pydantic import ValidationError

from llmgw.catalog.problems import pydantic_problems
from llmgw.catalog.types import Catalog
from llmgw.errors import CatalogInvalid
from llmgw.state import keys
from llmgw.state.store import HISTORY_LIMIT, Store
from llmgw.state.store.catalog import meta

__all__ = ["HISTORY_LIMIT", "AppliedCatalog", "apply_catalog", "catalog_from_doc", "parse_applied", "read_applied", "read_version"]


def catalog_from_doc(doc: dict, where: str) -> Catalog:
    """The catalog of a stored document. The stored spec was validated when applied and is fully
    resolved; only its structure is checked again, so a rule tightened in a later release never makes
    the running catalog unreadable."""
    try:
        return Catalog.model_validate(doc["spec"])
    except ValidationError as e:
        raise CatalogInvalid(where, pydantic_problems(e, "", "catalog")) from e


class AppliedCatalog(NamedTuple):
    """The applied catalog as read back: version 0, catalog None and no metadata when nothing was ever
    applied."""

    version: int
    catalog: Catalog | None
    meta: dict  # the stored document without its spec: who applied it, when, from what source


def parse_applied(raw: str | None) -> AppliedCatalog:
    """The applied document as stored (`Store.catalog_document`), read back."""
    if not raw:
        return AppliedCatalog(0, None, {})
    doc = json.loads(raw)
    return AppliedCatalog(int(doc["version"]), catalog_from_doc(doc, "redis:" + keys.CATALOG), meta(doc))


def read_applied(store: Store) -> AppliedCatalog:
    """The applied catalog, its version and metadata."""
    return parse_applied(store.catalog_document())


def read_version(store: Store, version: int) -> tuple[Catalog, dict] | None:
    """A past version still kept in the history (the last HISTORY_LIMIT), or None."""
    doc = store.catalog_history_document(version)
    if doc is None:
        return None
    return catalog_from_doc(doc, f"redis:{keys.CATALOG_HISTORY}[v{version}]"), meta(doc)


def apply_catalog(
    store: Store,
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
    version is no longer that one (`Store.store_catalog`: one WATCH/MULTI transaction).
    """
    return store.store_catalog(catalog.hash(), catalog.canonical(), source=source, applied_by=applied_by,
                               expected_version=expected_version, now=time.time() if now is None else now)

