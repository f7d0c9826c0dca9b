"""The node's weights cache: which sources are complete, whether a download has room, what to evict.

Layout under the cache root (one per node, `LLMGW_WEIGHTS_DIR`):

    hub/                     huggingface_hub's cache layout (models--ORG--REPO/{blobs,snapshots,refs},
                             .locks/): the same directory works as HF_HUB_CACHE for other tools
    url/<key>/<file>         plain URL sources (`<file>.incomplete` while it arrives, `.lock`)
    index/<key>.json         one manifest per complete source: written last, removed first

A source is complete exactly when its manifest exists; the manifest names the files it owns (with
their sizes) and the path its engine loads. Decisions are pure: `evict(entries, in_use, budget)`
and `room(...)`; the shell functions read and write the manifests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable

GIB = 1024 ** 3


@dataclass(frozen=True)
class Entry:
    """One complete source on this node."""

    key: str
    source: str
    path: str  # what the engine loads: a file (GGUF) or a directory (a repository snapshot)
    files: tuple[tuple[str, int], ...]  # (path under the cache root, bytes): the data this entry uses
    links: tuple[str, ...] = ()  # symlinks under the root that point into `files` (hub snapshots)
    commit: str | None = None
    completed_at: float = 0.0
    last_used: float = 0.0

    @property
    def size(self) -> int:
        return sum(n for _, n in self.files)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Entry":
        return cls(key=d["key"], source=d["source"], path=d["path"],
                   files=tuple((str(p), int(n)) for p, n in d.get("files", ())),
                   links=tuple(d.get("links", ())), commit=d.get("commit"),
                   completed_at=float(d.get("completed_at", 0.0)), last_used=float(d.get("last_used", 0.0)))


@dataclass(frozen=True)
class Room:
    """Whether a download of `needed` more bytes fits: the free disk and the node's budget."""

    needed: int
    free: int
    budget_left: int | None = None
    evict: tuple[Entry, ...] = field(default_factory=tuple)  # to remove first, so it fits the budget
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def source_key(source: str) -> str:
    """The cache key of a source as written (hf://org/repo and hf://org/repo@main are two keys)."""
    return hashlib.sha256(source.encode()).hexdigest()[:20]


def gib(n: float) -> str:
    """Bytes for a person: GiB with one decimal, MiB below 1 GiB ("14.2 GiB", "93.8 MiB")."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 1024 ** 2:.1f} MiB"


def used_bytes(entries: Iterable[Entry]) -> int:
    """Bytes the entries hold on disk, each file once (two sources may share a blob)."""
    seen: dict[str, int] = {}
    for e in entries:
        seen.update(dict(e.files))
    return sum(seen.values())


def evict(entries: Iterable[Entry], in_use: set[str], budget: int, needed: int = 0) -> tuple[Entry, ...]:
    """The least recently used entries to remove so that what stays, plus `needed`, fits `budget`.

    Never an entry in `in_use` (keys of sources a replica on the node runs or is about to start).
    A file shared with an entry that stays is not freed by removing the other; when even removing
    every unused entry is not enough, the result is every unused entry whose removal frees something."""
    keep = sorted(entries, key=lambda e: (e.last_used, e.completed_at, e.key))
    out: list[Entry] = []
    for e in list(keep):
        if used_bytes(keep) + needed <= budget:
            break
        if e.key in in_use:
            continue
        rest = [k for k in keep if k is not e]
        if used_bytes(rest) < used_bytes(keep):
            out.append(e)
            keep = rest
    return tuple(out)


def room(needed: int, free: int, where: str, *, entries: Iterable[Entry] = (), in_use: set[str] = frozenset(),
         budget: int | None = None) -> Room:
    """Whether `needed` more bytes can be downloaded under `where`: enough free disk, and within the
    node's `budget` once unused entries are evicted. `problem` reads "needs 14.2 GiB, 9.1 GiB free under DIR"."""
    entries = list(entries)
    to_evict: tuple[Entry, ...] = ()
    budget_left = None
    if budget is not None:
        to_evict = evict(entries, set(in_use), budget, needed)
        stay = [e for e in entries if e not in to_evict]
        budget_left = budget - used_bytes(stay)
        if needed > budget_left:
            return Room(needed, free, budget_left, to_evict,
                        f"needs {gib(needed)}, the weights budget has {gib(max(budget_left, 0))} left "
                        f"of {gib(budget)} under {where} (the rest is used by running replicas)")
    freed = used_bytes(entries) - used_bytes([e for e in entries if e not in to_evict])
    if needed > free + freed:
        return Room(needed, free, budget_left, to_evict, f"needs {gib(needed)}, {gib(free + freed)} free under {where}")
    return Room(needed, free, budget_left, to_evict)


def headroom(entries: Iterable[Entry], in_use: set[str], free: int, budget: int | None = None) -> int:
    """Bytes a new download may take on the node (what its heartbeat reports, for placement): the
    free disk plus what evicting every unused entry would free, within the budget less what the
    entries in use hold."""
    entries = list(entries)
    kept = [e for e in entries if e.key in in_use]
    room = free + used_bytes(entries) - used_bytes(kept)
    if budget is not None:
        room = min(room, budget - used_bytes(kept))
    return max(room, 0)


# --- the shell: manifests on disk --------------------------------------------------------------------
def index_dir(root: Path) -> Path:
    return root / "index"


def read_index(root: Path) -> list[Entry]:
    """Every complete source under `root`; a manifest that cannot be read is skipped (it is rewritten
    by the next download of its source)."""
    out = []
    d = index_dir(root)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            out.append(Entry.from_dict(json.loads(p.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def lookup(root: Path, source: str) -> Entry | None:
    p = index_dir(root) / f"{source_key(source)}.json"
    try:
        e = Entry.from_dict(json.loads(p.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # A manifest whose data is gone (removed by hand) is not complete any more.
    return e if all((root / f).exists() for f, _ in e.files) else None


def write_entry(root: Path, entry: Entry) -> None:
    """Record `entry` as complete (atomically: a reader sees the old manifest or the new one)."""
    d = index_dir(root)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{entry.key}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(entry.to_dict(), sort_keys=True))
    os.replace(tmp, d / f"{entry.key}.json")


def touch(root: Path, entry: Entry, now: float) -> Entry:
    """Mark `entry` used now (least-recent-use order)."""
    updated = replace(entry, last_used=now)
    write_entry(root, updated)
    return updated


def remove(root: Path, entry: Entry, remaining: Iterable[Entry]) -> int:
    """Remove `entry`: its manifest first (it is no longer complete), then its links and the files no
    remaining entry uses. Returns the bytes freed."""
    (index_dir(root) / f"{entry.key}.json").unlink(missing_ok=True)
    shared = {f for e in remaining if e.key != entry.key for f, _ in e.files} | \
             {link for e in remaining if e.key != entry.key for link in e.links}
    freed = 0
    for link in entry.links:
        if link not in shared:
            (root / link).unlink(missing_ok=True)
    for f, n in entry.files:
        if f in shared:
            continue
        try:
            (root / f).unlink()
            freed += n
        except FileNotFoundError:
            pass
    for p in {(root / x).parent for x in (*entry.links, *(f for f, _ in entry.files))}:
        _prune_empty(p, root)
    return freed


def _prune_empty(d: Path, root: Path) -> None:
    while d != root and root in d.parents:
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (its nearest existing parent)."""
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0
