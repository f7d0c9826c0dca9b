"""Make a source local on this node: the shell the node agent calls before an engine starts.

`Downloader(root).ensure(source, engine, on_progress, cancel)` returns where the engine loads the
weights from. A complete source (its manifest in the cache index) answers at once, without the
network. Otherwise: resolve (hub: one model-info call; URL: a HEAD), check the free disk against
what is still missing, then fetch each file under its own lock, resuming what is on disk. Two
replicas that need the same file share one fetch: the second waits on the lock and reports the
first one's progress, read from the partial file they both see. Progress goes out as data
(`Progress`: bytes done and total, rate, ETA) at most every `report_every` seconds.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import requests

from llmgw.weights import cache, hub, lock, meta, url
from llmgw.weights.errors import DownloadFailed
from llmgw.weights.sources import HubSource, UrlSource, parse_source

RATE_WINDOW = 10.0  # seconds of samples the rate is averaged over


@dataclass(frozen=True)
class Progress:
    source: str
    phase: str  # resolving | waiting (another replica's download holds the file) | downloading | verifying | complete
    done: int = 0
    total: int | None = None
    rate: float | None = None  # bytes per second over the last RATE_WINDOW seconds
    eta: float | None = None  # seconds
    file: str = ""  # the file being fetched (or waited for)

    @property
    def fraction(self) -> float | None:
        return self.done / self.total if self.total else None


@dataclass(frozen=True)
class Local:
    source: str
    path: str  # what the engine loads
    size: int
    commit: str | None = None
    fetched: int = 0  # bytes this call downloaded (0: it was complete already, or another fetched it)


class Meter:
    """Rate and ETA from (time, bytes done) samples: pure arithmetic over what it was told."""

    def __init__(self, window: float = RATE_WINDOW):
        self.window = window
        self.samples: list[tuple[float, int]] = []

    def sample(self, now: float, done: int, total: int | None) -> tuple[float | None, float | None]:
        self.samples.append((now, done))
        while len(self.samples) > 2 and self.samples[0][0] < now - self.window:
            self.samples.pop(0)
        (t0, d0) = self.samples[0]
        if now - t0 <= 0 or done < d0:
            return None, None
        rate = (done - d0) / (now - t0)
        eta = (total - done) / rate if rate > 0 and total is not None else None
        return rate, eta


@dataclass(frozen=True)
class Survey:
    """What placement needs of a source before any download: the bytes it takes on disk, and the
    model's shape for a fit estimate (None, with `problem`, when its headers cannot be read)."""

    source: str
    size: int | None
    shape: meta.Shape | None
    problem: str | None = None


class Downloader:
    """`budget` (bytes, LLMGW_WEIGHTS_BUDGET) and `in_use` (the cache keys of sources a replica on the
    node runs or is about to start) let a download evict unused sources first (`cache.room`);
    `on_evict` hears of each one removed."""

    def __init__(self, root: Path, environ: Mapping[str, str] | None = None,
                 session: requests.Session | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, free_bytes: Callable[[Path], int] = cache.free_bytes,
                 report_every: float = 1.0, sleep: Callable[[float], object] = time.sleep,
                 budget: int | None = None, in_use: Callable[[], set[str]] = set,
                 on_evict: Callable[[cache.Entry], None] = lambda e: None):
        self.root = Path(root)
        self.environ = os.environ if environ is None else environ
        self._session, self._local = session, threading.local()
        self.clock, self.wall, self.free_bytes = clock, wall, free_bytes
        self.report_every, self.sleep = report_every, sleep
        self.budget, self.in_use, self.on_evict = budget, in_use, on_evict
        self._evicting = threading.Lock()

    @property
    def session(self) -> requests.Session:
        """The injected session, else one per thread (the agent fetches several sources at once, and
        a requests Session is not meant to be shared between threads)."""
        if self._session is not None:
            return self._session
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    @property
    def hub_cache(self) -> Path:
        return self.root / "hub"

    def ensure(self, source_text: str, engine: str | None = None,
               on_progress: Callable[[Progress], None] = lambda p: None,
               cancel: threading.Event | None = None) -> Local | None:
        """Where the engine loads `source_text` from, downloading it first if it is remote and not
        complete here; None for a local path or pkg: (the engine resolves those itself)."""
        source = parse_source(source_text)
        if not isinstance(source, (HubSource, UrlSource)):
            return None
        name = str(source)
        done = cache.lookup(self.root, name)
        if done is not None:
            on_progress(Progress(name, "complete", done.size, done.size))
            return Local(name, done.path, done.size, done.commit)
        on_progress(Progress(name, "resolving"))
        if isinstance(source, HubSource):
            return self._hub(source, engine or "", on_progress, cancel)
        return self._url(source, on_progress, cancel)

    def shape(self, source_text: str, engine: str | None = None) -> meta.Shape | None:
        """The model's shape for a fit estimate, without downloading the weights (`survey`'s); None for a
        local path or pkg: (read those with `meta.local_shape`), or when the headers cannot be read."""
        got = self.survey(source_text, engine)
        return got.shape if got is not None else None

    def survey(self, source_text: str, engine: str | None = None) -> Survey | None:
        """The source's size and shape (`shape`), from the cache when it is complete here, else from one
        resolve and ranged header reads. Raises DownloadFailed when the source cannot be resolved (401,
        404, ...); a header that cannot be read leaves the shape None and says why. None for a local
        path or pkg:."""
        source = parse_source(source_text)
        if not isinstance(source, (HubSource, UrlSource)):
            return None
        name = str(source)
        done = cache.lookup(self.root, name)
        if done is not None:
            return _with_shape(name, done.size, lambda: meta.local_shape(Path(done.path)))
        if isinstance(source, UrlSource):
            h = url.head(self.session, source.url, {"User-Agent": "llmgw"}, name)
            return _with_shape(name, h.size, lambda: meta.shape_of(
                {source.filename: meta.http_fetch(self.session, source.url)}))
        env = hub.HubEnv.from_environ(self.environ)
        plan = hub.resolve(source, engine or "", self.hub_cache, env)
        wanted = [f for f in plan.files if f.path.endswith((".gguf", ".safetensors")) or f.path == "config.json"]
        headers = env.headers()
        return _with_shape(name, plan.total, lambda: meta.shape_of(
            {f.path: meta.http_fetch(self.session, f.url, headers) for f in wanted}))

    # --- hub ----------------------------------------------------------------------------------
    def _hub(self, source: HubSource, engine: str, on_progress, cancel) -> Local:
        env = hub.HubEnv.from_environ(self.environ)
        plan = hub.resolve(source, engine, self.hub_cache, env)
        name = str(source)
        targets = [(plan.blob(f), f.size) for f in plan.files]
        self._check_room(name, targets)
        report = _Reporter(name, targets, on_progress, self.clock, self.report_every)
        fetched = 0
        headers = env.headers()
        for f in plan.files:
            blob = plan.blob(f)
            if not _complete(blob, f.size):
                fetched += self._locked_fetch(plan.lock(f, self.hub_cache), blob, f.url, name, f.size,
                                              plan.digest(f), headers, None, report, cancel, f.path)
            hub.link(plan, f)
        hub.write_ref(plan)
        root_rel = lambda p: str(p.relative_to(self.root))  # noqa: E731
        path = plan.link(plan.files[0]) if engine == "llamacpp" or source.path else plan.storage / "snapshots" / plan.commit
        entry = cache.Entry(key=cache.source_key(name), source=name, path=str(path),
                            files=tuple((root_rel(plan.blob(f)), f.size) for f in plan.files),
                            links=tuple(root_rel(plan.link(f)) for f in plan.files), commit=plan.commit,
                            completed_at=self.wall(), last_used=self.wall())
        cache.write_entry(self.root, entry)
        report.finish()
        return Local(name, entry.path, entry.size, plan.commit, fetched)

    # --- plain URL ----------------------------------------------------------------------------
    def _url(self, source: UrlSource, on_progress, cancel) -> Local:
        name = str(source)
        key = cache.source_key(source.url)
        final = self.root / "url" / key / (source.filename or "file")
        headers = {"User-Agent": "llmgw"}
        if not _complete(final, None):
            h = url.head(self.session, source.url, headers, name)
            targets = [(final, h.size)]
            self._check_room(name, targets)
            report = _Reporter(name, targets, on_progress, self.clock, self.report_every)
            digest = url.Digest("sha256", source.sha256) if source.sha256 else None
            validator = h.etag if h.etag and not h.etag.startswith("W/") else h.last_modified
            fetched = self._locked_fetch(final.parent / ".lock", final, source.url, name, h.size, digest,
                                         headers, validator, report, cancel, final.name)
        else:
            report, fetched = None, 0
        size = final.stat().st_size
        entry = cache.Entry(key=cache.source_key(name), source=name, path=str(final),
                            files=((str(final.relative_to(self.root)), size),),
                            completed_at=self.wall(), last_used=self.wall())
        cache.write_entry(self.root, entry)
        if report is not None:
            report.finish()
        return Local(name, entry.path, size, None, fetched)

    # --- shared -------------------------------------------------------------------------------
    def _check_room(self, name: str, targets: list[tuple[Path, int | None]]) -> None:
        """Room for what is still missing: the free disk, and the budget once unused sources (least
        recently used first, never one in `in_use`) are evicted; those are removed before the fetch."""
        needed = sum(max((n or 0) - _on_disk(p), 0) for p, n in targets)
        with self._evicting:  # two downloads must not both count the same evictions
            entries = cache.read_index(self.root) if self.budget is not None else []
            keep = set(self.in_use()) | {cache.source_key(name)}
            r = cache.room(needed, self.free_bytes(self.root), str(self.root), entries=entries, in_use=keep,
                           budget=self.budget)
            if not r.ok:
                raise DownloadFailed(name, "disk_full", r.problem or "no room")
            for e in r.evict:
                cache.remove(self.root, e, [x for x in entries if x.key != e.key and x not in r.evict])
                self.on_evict(e)

    def _locked_fetch(self, lock_path: Path, final: Path, link: str, name: str, size: int | None,
                      digest, headers, validator, report: "_Reporter", cancel, label: str) -> int:
        report.file = label
        try:
            with lock.held(lock_path, cancel=cancel, on_wait=lambda: report.tick("waiting")):
                if _complete(final, size):  # the holder we waited for finished it
                    return 0
                return url.fetch(self.session, link, final, source=name, size=size, digest=digest,
                                 headers=headers, if_range=validator, cancel=cancel, sleep=self.sleep,
                                 on_bytes=lambda n: report.tick("downloading"),
                                 on_verify=lambda: report.tick("verifying", force=True))
        except lock.Cancelled:
            raise DownloadFailed(name, "cancelled", "the download was cancelled while another one held the file") from None


class _Reporter:
    """Progress of one source, measured on disk (so a waiter sees the holder's bytes), sent at most
    every `every` seconds."""

    def __init__(self, name: str, targets: list[tuple[Path, int | None]], out, clock, every: float):
        self.name, self.targets, self.out, self.clock, self.every = name, targets, out, clock, every
        self.total = sum(n for _, n in targets) if all(n is not None for _, n in targets) else None
        self.meter, self.last, self.file = Meter(), None, ""

    def done(self) -> int:
        return sum(_on_disk(p) for p, _ in self.targets)

    def tick(self, phase: str, force: bool = False) -> None:
        now = self.clock()
        if not force and self.last is not None and now - self.last < self.every:
            return
        self.last = now
        done = self.done()
        rate, eta = self.meter.sample(now, done, self.total)
        self.out(Progress(self.name, phase, done, self.total, rate, eta, self.file))

    def finish(self) -> None:
        done = self.done()
        self.out(Progress(self.name, "complete", done, self.total if self.total is not None else done))


def _with_shape(name: str, size: int | None, read: Callable[[], meta.Shape]) -> Survey:
    try:
        return Survey(name, size, read())
    except DownloadFailed:
        raise
    except (meta.MetaError, requests.RequestException, OSError, ValueError, KeyError) as e:
        return Survey(name, size, None, f"cannot read the model's shape from its headers: {e}")


def _complete(p: Path, size: int | None) -> bool:
    try:
        return p.stat().st_size == size if size is not None else p.is_file()
    except OSError:
        return False


def _on_disk(p: Path) -> int:
    """Bytes of `p` present: the whole file when it is complete, else its partial."""
    for candidate in (p, p.with_name(p.name + ".incomplete")):
        try:
            return candidate.stat().st_size
        except OSError:
            continue
    return 0
