"""LLMGW_CATALOG: keep the applied catalog in step with a file the operator edits.

The control plane calls `sync_from_file` at the start of every reconcile pass (every 2 s). It costs
one `stat` and one HGETALL while the file is unchanged. When the file changes it is re-read: a valid
catalog is applied as the next version; an invalid one is logged once (per content, across workers
and restarts, because what was seen is kept in Redis) and ignored, so the running catalog stays.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.catalog import check_catalog_size, parse_catalog_bytes
from llmgw.catalog.store import apply_catalog
from llmgw.errors import CatalogInvalid, NotReplicated
from llmgw.state import keys
from llmgw.state.store import Store

log = logging.getLogger("llmgw.catalog")

LOCK_TTL = 10.0  # seconds; an apply is one small transaction


@dataclass(frozen=True)
class SyncResult:
    applied: bool  # a new version was stored by this call
    version: int  # the applied version as of this call (as of the last file change when unchanged)
    problems: list[str] = field(default_factory=list)  # why the file's current content is not applied


def _stamp(path: Path) -> str:
    st = path.stat()
    # inode catches an atomic rename (editors, ConfigMap updates); ctime catches an in-place rewrite
    # that preserved mtime.
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _cached(state: dict) -> SyncResult:
    return SyncResult(False, int(state.get("version") or 0), json.loads(state.get("problems") or "[]"))


def sync_from_file(store: Store, path: Path, applied_by: str) -> SyncResult:
    """Apply `path` if it changed since the last call (by any control worker); see the module doc."""
    path = Path(path)
    state = store.catalog_file_state()
    same_file = state.get("path") == str(path)
    try:
        stamp = _stamp(path)
        if same_file and state.get("stamp") == stamp:
            return _cached(state)
        check_catalog_size(path)
        data = path.read_bytes()
    except CatalogInvalid as e:  # too big to read
        return _refused(store, path, stamp, "", e)
    except OSError as e:
        stamp = f"unreadable:{e.errno}"
        if same_file and state.get("stamp") == stamp:
            return _cached(state)
        problems = [f"{path}: cannot read: {e.strerror}"]
        version = store.catalog_version()
        log.warning("catalog file %s cannot be read (%s); keeping catalog version %d", path, e.strerror, version)
        _remember(store, path, stamp, "", version, problems)
        return SyncResult(False, version, problems)

    sha = hashlib.sha256(data).hexdigest()
    if same_file and state.get("sha") == sha:
        # Touched or rewritten with the same bytes: nothing to do, and nothing to log again.
        _remember(store, path, stamp, sha, int(state.get("version") or 0), json.loads(state.get("problems") or "[]"))
        return _cached(state)

    try:
        catalog = parse_catalog_bytes(data, str(path))
    except CatalogInvalid as e:
        return _refused(store, path, stamp, sha, e)

    with store.lock(keys.CATALOG_FILE_LOCK, LOCK_TTL) as held:
        if not held:
            # Another control worker is applying this very change; the next pass sees its result.
            return SyncResult(False, store.catalog_version(), [])
        try:
            version, changed = apply_catalog(store, catalog, source=str(path), applied_by=applied_by)
        except NotReplicated as e:  # applied on the master; not yet safe from a failover
            log.warning("catalog file %s: %s", path, e)
            version, changed = e.value
        _remember(store, path, stamp, sha, version, [])
    if changed:
        log.info("catalog file %s applied as version %d (hash %s)", path, version, catalog.hash())
    return SyncResult(changed, version, [])


def _refused(store: Store, path: Path, stamp: str, sha: str, e: CatalogInvalid) -> SyncResult:
    problems = [f"{e.source}: {p}" for p in e.problems]
    version = store.catalog_version()
    log.warning("catalog file %s changed but is invalid; keeping catalog version %d:\n  %s",
                path, version, "\n  ".join(problems))
    _remember(store, path, stamp, sha, version, problems)
    return SyncResult(False, version, problems)


def _remember(store: Store, path: Path, stamp: str, sha: str, version: int, problems: list[str]) -> None:
    store.remember_catalog_file(path=str(path), stamp=stamp, sha=sha, version=version, problems=json.dumps(problems))
