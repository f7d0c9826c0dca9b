"""The node agent's weights: downloads before engines start, the reads placement needs, and pulls.

- `Fetcher`: one download per source on this node, `LLMGW_DOWNLOADS` at a time, in threads around
  `llmgw.weights.download.Downloader`. Replicas (and pulls) subscribe to a source (`want`), read
  its progress (`view`, an `supervisor.Fetch`) and drop out (`release`); a download nobody wants any
  more is cancelled. What to fetch and when is `supervisor.decide`'s; the loop applies it.
- `Surveyor`: before placement can check a remote source against a node's disk and GPU memory, some
  node agent reads its size and its model's shape (`Downloader.survey`: one resolve, ranged header
  reads) and stores them (`Store.write_weights_facts`); one agent per source, by a claim.
- `Pulls`: what `llmgw models pull` asked of this node, fetched like a replica's weights.
- `part_source`: the remote source a catalog profile loads and how its files are laid out.
`NodeWeights` holds the three for the agent: what the loop observes of a part's download and how it
applies the decisions' download actions, the heartbeat's cache report, and the side pass.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from llmgw.catalog import Catalog, Model, Profile
from llmgw.engines import get_engine
from llmgw.state.kicks import RECONCILE
from llmgw.state.node_records import CachedWeights
from llmgw.state.records import ReplicaRecord
from llmgw.state.weights import PullStatus, WeightsFacts
from llmgw.state.store import Store
from llmgw.weights import cache
from llmgw.weights.download import Downloader, Progress
from llmgw.weights.errors import DownloadFailed, SourceInvalid
from llmgw.weights.sources import REMOTE, parse_source
from workers.agent import supervisor as sv
from workers.agent.supervisor import Fetch

log = logging.getLogger("llmgw.agent")

SURVEY_CLAIM = 120.0  # seconds one agent has to read a source's headers before another may
FAILED_FACTS_TTL = 30.0  # a source that could not be read is read again after this
CACHE_REPORT_EVERY = 10.0  # the heartbeat re-reads the cache index this often (and after each change)


def part_source(model: Model, profile: Profile) -> tuple[str, str] | None:
    """(the remote source `profile` loads, normalised; its layout) or None: a local source, a name the
    engine resolves itself, or an engine that loads no weights."""
    text = model.source_for(profile)
    try:
        source = parse_source(text)
    except SourceInvalid:
        return None  # the catalog's validation refused it already; nothing to download
    if not isinstance(source, REMOTE):
        return None
    layout = get_engine(profile.engine).weights_layout(str(source))
    return (str(source), layout) if layout else None


def remote_sources(catalog: Catalog | None) -> dict[str, str]:
    """Every remote source of the catalog's profiles -> its layout."""
    out: dict[str, str] = {}
    for model, profile in catalog.profiles() if catalog else ():
        found = part_source(model, profile)
        if found:
            out.setdefault(*found)
    return out


class _Job:
    def __init__(self, source: str, layout: str):
        self.source, self.layout = source, layout
        self.cancel = threading.Event()
        self.view = Fetch("queued")
        self.who: set[str] = set()
        self.finished = False


class Fetcher:
    def __init__(self, downloader: Downloader, workers: int = 2, clock: Callable[[], float] = time.monotonic,
                 on_done: Callable[[str, Fetch], None] = lambda source, view: None):
        self.downloader, self.clock, self.on_done = downloader, clock, on_done
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmgw-fetch")
        self.lock = threading.Lock()
        self.jobs: dict[str, _Job] = {}  # source -> its download
        self.subs: dict[str, str] = {}  # replica id (or pull:<source>) -> source
        # Cache keys of sources a replica on this node runs or is about to start: never evicted.
        self.in_use: frozenset[str] = frozenset()
        downloader.in_use = lambda: set(self.in_use)
        self._report: tuple[float, list[cache.Entry]] | None = None

    def want(self, who: str, source: str, layout: str) -> None:
        """Subscribe `who` to the download of `source` (started if none runs; a finished failure is
        not joined: a new try starts)."""
        with self.lock:
            if self.subs.get(who) not in (None, source):
                self._drop(who)
            job = self.jobs.get(source)
            if job is None or job.cancel.is_set() or (job.finished and job.view.phase == "failed" and who not in job.who):
                job = self.jobs[source] = _Job(source, layout)
                self.pool.submit(self._run, job)
            job.who.add(who)
            self.subs[who] = source

    def view(self, who: str) -> Fetch | None:
        with self.lock:
            job = self.jobs.get(self.subs.get(who, ""))
            return job.view if job is not None and who in job.who else None

    def release(self, who: str) -> None:
        """`who` no longer needs its download; with no one left, it is cancelled (what is on disk stays,
        and the next download of the source continues from it)."""
        with self.lock:
            self._drop(who)

    def subscribers(self) -> set[str]:
        with self.lock:
            return set(self.subs)

    def _drop(self, who: str) -> None:
        source = self.subs.pop(who, None)
        job = self.jobs.get(source) if source is not None else None
        if job is None:
            return
        job.who.discard(who)
        if not job.who:
            job.cancel.set()
            del self.jobs[source]

    def _run(self, job: _Job) -> None:
        if job.cancel.is_set():
            return
        t0 = self.clock()
        try:
            local = self.downloader.ensure(job.source, job.layout, on_progress=lambda p: self._progress(job, p),
                                           cancel=job.cancel)
            assert local is not None  # only remote sources are fetched
            view = Fetch("complete", local.size, local.size, path=local.path, fetched=local.fetched,
                         seconds=self.clock() - t0)
        except DownloadFailed as e:
            view = Fetch("failed", kind=e.kind, reason=e.reason)
        except Exception as e:  # noqa: BLE001 - any other failure is this download's, with its words
            log.exception("downloading %s failed", job.source)
            view = Fetch("failed", kind="error", reason=f"the download stopped: {e!r}")
        job.view, job.finished = view, True
        self._report = None  # the cache changed: the next heartbeat reads it again
        if not job.cancel.is_set():
            self.on_done(job.source, view)

    @staticmethod
    def _progress(job: _Job, p: Progress) -> None:
        if p.phase != "complete":  # complete comes with its path when ensure returns
            job.view = Fetch(p.phase, p.done, p.total, p.rate, p.eta, p.file)

    # --- the cache -----------------------------------------------------------------------------------
    def touch(self, source: str, now: float) -> None:
        """`source` starts an engine now (least-recent-use order for eviction)."""
        entry = cache.lookup(self.downloader.root, source)
        if entry is not None:
            cache.touch(self.downloader.root, entry, now)

    def cache_report(self) -> tuple[list[cache.Entry], int, int]:
        """(complete sources, free bytes, bytes a new download may take) for the heartbeat; the index is
        read again every CACHE_REPORT_EVERY seconds, and after each download."""
        now = self.clock()
        if self._report is None or now - self._report[0] >= CACHE_REPORT_EVERY:
            self._report = (now, cache.read_index(self.downloader.root))
        entries = self._report[1]
        free = cache.free_bytes(self.downloader.root)
        return entries, free, cache.headroom(entries, set(self.in_use), free, self.downloader.budget)

    def close(self) -> None:
        with self.lock:
            for job in self.jobs.values():
                job.cancel.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


class Surveyor:
    """Reads the size and shape of the catalog's remote sources that have no facts yet (one claimed
    source at a time per agent, in its own thread: never behind a long download)."""

    def __init__(self, downloader: Downloader, store: Store, node: str, wall: Callable[[], float] = time.time,
                 on_written: Callable[[], None] = lambda: None):
        self.downloader, self.store, self.node, self.wall, self.on_written = downloader, store, node, wall, on_written
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-survey")
        self.busy: set[str] = set()

    def step(self, sources: dict[str, str]) -> None:
        if not sources:
            return
        known = self.store.weights_facts(sources)
        for source, layout in sorted(sources.items()):
            if source in known or source in self.busy:
                continue
            if self.store.claim_weights_read(source, self.node, SURVEY_CLAIM):
                self.busy.add(source)
                self.pool.submit(self._read, source, layout)

    def _read(self, source: str, layout: str) -> None:
        try:
            try:
                got = self.downloader.survey(source, layout)
                facts = WeightsFacts(source, layout, size=got.size if got else None,
                                     shape=asdict(got.shape) if got and got.shape else None,
                                     error=got.problem if got else None, read_at=self.wall(), node=self.node)
                ttl = None if got and got.shape else FAILED_FACTS_TTL
            except DownloadFailed as e:
                facts, ttl = WeightsFacts(source, layout, error=f"{e.kind}: {e.reason}", read_at=self.wall(),
                                          node=self.node), FAILED_FACTS_TTL
            self.store.write_weights_facts(facts, ttl)
            log.info("read %s: %s", source, facts.error or f"{facts.size} bytes")
            self.on_written()
        except Exception:  # noqa: BLE001 - logged; the claim expires and some agent reads it again
            log.exception("reading the headers of %s failed", source)
        finally:
            self.busy.discard(source)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class PullStep:
    """What one look at the pulls asks of the fetcher and the store."""

    want: tuple[tuple[str, str], ...]  # (source, layout) to subscribe
    report: tuple[tuple[PullStatus, bool], ...]  # (status, done) to write


def pull_step(requests: dict[str, str], views: dict[str, Fetch | None], now: float) -> PullStep:
    """Pure: subscribe each requested pull, report how each goes, finish those complete or failed."""
    want, report = [], []
    for source, layout in sorted(requests.items()):
        v = views.get(source)
        if v is None:
            want.append((source, layout))
            continue
        done = v.phase in ("complete", "failed")
        report.append((PullStatus(source, v.phase, v.done, v.total, v.rate, v.eta, v.reason, v.kind, now), done))
    return PullStep(tuple(want), tuple(report))


class Pulls:
    def __init__(self, fetcher: Fetcher, store: Store, node: str, wall: Callable[[], float] = time.time):
        self.fetcher, self.store, self.node, self.wall = fetcher, store, node, wall

    def step(self) -> None:
        requests = self.store.pull_requests(self.node)
        views = {s: self.fetcher.view(f"pull:{s}") for s in requests}
        todo = pull_step(requests, views, self.wall())
        for source, layout in todo.want:
            self.fetcher.want(f"pull:{source}", source, layout)
        for status, done in todo.report:
            self.store.write_pull_status(self.node, status, done=done)
            if done:
                self.fetcher.release(f"pull:{status.source}")
        for who in self.fetcher.subscribers():  # a pull taken off the list (or never ours)
            if who.startswith("pull:") and who[5:] not in requests:
                self.fetcher.release(who)


def in_use_keys(sources: Iterable[str | None]) -> frozenset[str]:
    """The cache keys of the (normalised) sources of this node's replicas that are not stopped."""
    return frozenset(cache.source_key(s) for s in sources if s)


@dataclass(frozen=True)
class CacheReport:
    """The node's weights cache for its heartbeat."""

    entries: tuple[CachedWeights, ...]
    where: str
    free: int
    room: int
    budget: int | None


class NodeWeights:
    """The agent's downloads, header reads and pulls over one `Downloader` (the node's cache dir)."""

    def __init__(self, fetcher: Fetcher, surveyor: Surveyor, pulls: Pulls):
        self.fetcher, self.surveyor, self.pulls = fetcher, surveyor, pulls

    @classmethod
    def for_agent(cls, settings, store: Store, kick: Callable[[str], object] = lambda task: None) -> "NodeWeights":
        node = settings.node_name

        def evicted(e: cache.Entry) -> None:
            log.info("evicted %s (%s) under LLMGW_WEIGHTS_BUDGET", e.source, cache.gib(e.size))
            store.emit("weights_evicted", f"{e.source}: {cache.gib(e.size)}, the least recently used, to stay "
                                          "under LLMGW_WEIGHTS_BUDGET", source=f"agent:{node}", node=node)

        downloader = Downloader(settings.weights_dir, budget=settings.weights_budget, on_evict=evicted)
        fetcher = Fetcher(downloader, settings.downloads, on_done=lambda source, view: store.wake_agent(node, "weights"))
        return cls(fetcher, Surveyor(downloader, store, node, on_written=lambda: kick(RECONCILE)),
                   Pulls(fetcher, store, node))

    # --- the loop's pass ---------------------------------------------------------------------------
    def observe(self, view: ReplicaRecord, lookup: Callable[[], tuple[Model, Profile] | None]) -> dict:
        """The `Observed` fields of a part that is not running: its remote source (if any; `lookup`
        finds its catalog entry, asked only of a part not asked to stop) and the node's download of it."""
        fetch = self.fetcher.view(view.id)
        found = lookup() if view.stop_requested_at is None else None
        src = part_source(*found) if found is not None else None
        if src is None:
            return {"fetch": fetch}
        return {"weights_source": src[0], "weights_layout": src[1], "fetch": fetch}

    def act(self, actions: Iterable[sv.Action], views: Iterable[ReplicaRecord]) -> None:
        """Start and drop the downloads the pass decided (after its facts are written), and keep what
        this node's replicas use out of eviction."""
        sources = {v.weights_source for v in views if v.stop_requested_at is None}
        for a in actions:
            if isinstance(a, sv.FetchWeights):
                self.fetcher.want(a.replica_id, a.source, a.layout)
                sources.add(a.source)
            elif isinstance(a, sv.CancelFetch):
                self.fetcher.release(a.replica_id)
        self.fetcher.in_use = in_use_keys(sources)

    def forget_except(self, ids: set[str]) -> None:
        """Drop the downloads of replicas whose record is gone."""
        for who in self.fetcher.subscribers():
            if not who.startswith("pull:") and who not in ids:
                self.fetcher.release(who)

    def started(self, rec: ReplicaRecord, now: float) -> None:
        if rec.weights_source:
            self.fetcher.touch(rec.weights_source, now)

    # --- the heartbeat and the side pass -------------------------------------------------------------
    def report(self) -> CacheReport:
        entries, free, room = self.fetcher.cache_report()
        d = self.fetcher.downloader
        return CacheReport(tuple(CachedWeights(e.source, e.size, e.last_used) for e in entries), str(d.root),
                           free, room, d.budget)

    def side_pass(self, catalog: Catalog | None) -> None:
        self.surveyor.step(remote_sources(catalog))
        self.pulls.step()

    def close(self) -> None:
        self.fetcher.close()
        self.surveyor.close()
