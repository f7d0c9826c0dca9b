"""The catalog: its types, validation, YAML loading, diff, reading and applying it, and the file watch.

Other packages import the public names from here (`from llmgw.catalog import Catalog, apply_catalog`).
The types are imported at once; every other name on first use (PEP 562). That is not a cycle between
modules but how Python imports packages: the engine drivers import `llmgw.catalog.types`, which runs
this file first, and validation imports the drivers, so importing `validate` here eagerly would import
the drivers in the middle of their own import. The layering (types < engines < lora < validate < load,
diff, store, compact < watch) is declared in pyproject.toml and checked by import-linter.
"""

from __future__ import annotations

import importlib

from llmgw.catalog.types import (
    DRAIN_TIMEOUT,
    ENGINE_DEFAULTS,
    ENGINE_NAMES,
    EXTERNAL_FIELDS,
    SERVER_KINDS,
    Adapter,
    Catalog,
    GPURequest,
    LoraSlots,
    MetricMapping,
    Model,
    Profile,
)
from llmgw.catalog.spec import LAUNCH_FIELDS, profile_spec_hash


_LAZY = {
    "parse_catalog": "validate",
    "parse_catalog_text": "load",
    "parse_catalog_bytes": "load",
    "check_catalog_size": "load",
    "load_catalog_file": "load",
    "CatalogDiff": "diff",
    "diff_catalogs": "diff",
    "format_diff": "diff",
    "compact_spec": "compact",
    "compact_yaml": "compact",
    "HISTORY_LIMIT": "store",
    "apply_catalog": "store",
    "AppliedCatalog": "store",
    "parse_applied": "store",
    "read_applied": "store",
    "read_version": "store",
    "SyncResult": "watch",
    "sync_from_file": "watch",
}

__all__ = ["DRAIN_TIMEOUT", "ENGINE_DEFAULTS", "ENGINE_NAMES", "EXTERNAL_FIELDS", "LAUNCH_FIELDS", "SERVER_KINDS", "Adapter", "Catalog", "GPURequest", "LoraSlots", "MetricMapping", "Model", "Profile",
           "profile_spec_hash", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmgw.catalog' has no attribute {name!r}")
    return getattr(importlib.import_module(f"llmgw.catalog.{module}"), name)
