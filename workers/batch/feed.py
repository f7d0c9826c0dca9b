"""One run of one batch: a thin shell around `workers.batch.decide`.

The run takes the batch's lease (one run feeds a batch at a time; a killed worker's lease expires
and the sweep sends another run), then loops: every `view_interval` it reads the batch, the fleet's
load and the other feeders' counts (one read), decides how many lines it may have in flight
(`allowance`) and what the batch needs (`step`: feed, drain, seal); between views it sends the next
unanswered lines, each on a thread of its own and marked as this run's (`feeder_id`: the gateways
count each run's lines in their reports, which is how the allowance tells them from others'), and
records each answer as it comes (`judge`; the store's line script writes a line once and bills it
once). A slice later it hands the batch back to the queue, so more batches than threads take turns.

Lines already answered are skipped by reading the results (a page per chunk), so a run that takes
over a batch sends only what is missing: a line whose answer came back after the last run died and
before it was written is sent again, and its answer kept (and billed) once.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator

from llmgw.batch.config import BatchSettings
from llmgw.batch.lines import Request, requests_in
from llmgw.batch.rules import owner_refusal
from llmgw.batch.shapes import answer_line, error_line, usage_of
from llmgw.state.batch_records import ANONYMOUS_OWNER, BatchRecord, FileRecord
from llmgw.state.store import RedisError, Store
from llmgw.state.store.batches import Bill
from workers.batch.client import Answer, deadline_header
from workers.batch.decide import (
    Again,
    Throttle,
    Drain,
    Feed,
    Finish,
    GiveUp,
    Keep,
    Nothing,
    Seal,
    judge,
    learn_slots,
    room,
    step,
)

log = logging.getLogger("llmgw.batch")

PROGRESS_EVERY = 5.0  # seconds between progress samples (the console's rate)
PROGRESS_KEEP = 12
REFUSED_PER_PASS = 500  # error lines written between two views when the owner may not run the batch
FEEDER_STALE = 3.0  # seconds after which another feeder's count is forgotten


@dataclass(order=True)
class Retry:
    due: float
    index: int
    req: Request = field(compare=False)
    tries: int = field(compare=False, default=0)


@dataclass
class Outcome:
    """How a run ended, for the task's log line and its tests."""

    batch_id: str
    result: str  # "held" (another run feeds it), "gone", "sliced", "ended", "lost lease"
    sent: int = 0
    recorded: int = 0


class Run:
    def __init__(self, store: Store, settings: BatchSettings, send_line: Callable[..., Answer],
                 batch_id: str, token: str, kick_run: Callable[[str], None],
                 clock: Callable[[], float] = time.time, pool: ThreadPoolExecutor | None = None):
        self.store, self.settings, self.send_line = store, settings, send_line
        self.batch_id, self.token, self.kick_run, self.clock = batch_id, token, kick_run, clock
        self.pool = pool
        self.inflight: dict[Future, tuple[Request, int]] = {}
        self.retries: list[Retry] = []
        self.slots_seen: dict[str, int] = {}
        self.throttle = Throttle(settings.max_inflight)
        self.feeder = feeder_id(token)
        self.paused_until = 0.0  # no gateway answers (or no replica): nothing new until then
        self.refusal: tuple[str, str] | None = None
        self.bill: Bill | None = None
        self.progress: list[list[float]] = []
        self.last_progress = 0.0
        self.outcome = Outcome(batch_id, "ended")

    # --- the loop --------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        s, store = self.settings, self.store
        if not store.take_batch_lease(self.batch_id, self.token, s.lease_ttl):
            return Outcome(self.batch_id, "held")
        store.clear_batch_queued(self.batch_id)
        own_pool = self.pool is None
        pool = self.pool or ThreadPoolExecutor(max_workers=s.max_inflight, thread_name_prefix=f"batch-{self.batch_id[-6:]}")
        b: BatchRecord | None = None
        try:
            b = store.batch(self.batch_id)
            if b is None:
                store.forget_active(self.batch_id)
                return Outcome(self.batch_id, "gone")
            if b.in_progress_at is None and b.sealed_at is None and not b.ended:
                store.update_batch(self.batch_id, in_progress_at=self.clock())
            self.progress = [list(p) for p in b.progress][-PROGRESS_KEEP:]
            b = self._loop(pool, b)
        finally:
            self._drain_quietly()
            if own_pool:
                pool.shutdown(wait=False, cancel_futures=True)
            try:
                if b is not None and b.model:
                    store.drop_feeder(b.model, self.token)
                store.release_batch_lease(self.batch_id, self.token)
            except RedisError:
                pass
        if self.outcome.result in ("sliced", "lost lease"):
            self.kick_run(self.batch_id)  # the queue takes it from here (the sweep, if this send fails)
        return self.outcome

    def _loop(self, pool: ThreadPoolExecutor, b: BatchRecord) -> BatchRecord:
        s, store = self.settings, self.store
        f = store.file(b.input_file_id)
        lines = self._unanswered(f)
        looked = 0  # how often every line was found sent and answered while the counts said otherwise
        started = self.clock()
        next_view = 0.0
        while True:
            now = self.clock()
            if now >= next_view:
                fresh = self._view(now)
                if fresh is None:
                    self.outcome.result = "gone"
                    return b
                b = fresh
                if not store.renew_batch_lease(self.batch_id, self.token, s.lease_ttl):
                    log.warning("batch %s: lost its lease; another run takes over", self.batch_id)
                    self.outcome.result = "lost lease"
                    return b
                next_view = now + s.view_interval
            todo = step(b, now, len(self.inflight), s.drain_seconds)
            if isinstance(todo, Nothing):
                return b
            if isinstance(todo, (Seal, Finish)):
                if isinstance(todo, Seal):
                    self._seal(b, todo.why, f)
                self._finish()
                return b
            if isinstance(todo, Feed):
                sliced = now - started >= s.slice_seconds
                if sliced and not self.inflight:
                    self.outcome.result = "sliced"
                    return b
                if not sliced and self._dispatch(pool, lines, b, now) and not self.inflight and not self.retries:
                    # Every line was sent and answered: a view now counts the last answers (step then
                    # seals it). Lines still unanswered after that are looked for again, once.
                    looked += 1
                    if looked % 2 == 1:
                        next_view = now
                    elif looked == 2:
                        lines = self._unanswered(f)
                    else:
                        log.error("batch %s: %d of %d lines answered and none left to send (its input file "
                                  "gone?); sealing it", self.batch_id, b.done, b.total)
                        self._seal(b, "completed", f)
                        self._finish()
                        return b
            self._collect(0.05 if self.inflight else 0.02)

    # --- reading ---------------------------------------------------------------------------------------
    def _unanswered(self, f: FileRecord | None, busy_too: bool = False) -> Iterator[Request]:
        """The file's requests without a result yet, in order (a page of results read per chunk); those
        in flight or waiting for a retry only with `busy_too`."""
        if f is None:
            return iter(())
        store = self.store

        def gen() -> Iterator[Request]:
            page: list[Request] = []
            for req in requests_in(store.file_chunks(f.id)):
                page.append(req)
                if len(page) >= 256:
                    yield from self._missing(page, busy_too)
                    page = []
            if page:
                yield from self._missing(page, busy_too)

        return gen()

    def _missing(self, page: list[Request], busy_too: bool = False) -> list[Request]:
        done = self.store.answered(self.batch_id, [r.index for r in page])
        busy = set() if busy_too else {r.index for r, _ in self.inflight.values()} | {r.index for r in self.retries}
        return [r for r in page if r.index not in done and r.index not in busy]

    def _view(self, now: float) -> BatchRecord | None:
        """One read of what the decisions need: the batch, its owner's key and budget, the fleet."""
        store, s = self.store, self.settings
        fresh = store.batch(self.batch_id)
        if fresh is None:
            return None
        _version, _fp, endpoints = store.read_endpoints()
        mine = [e for e in endpoints if fresh.model in e.models]
        loads = store.loads([e.id for e in mine])
        reports = store.gateway_reports()
        feeders = store.feeders(fresh.model, now, FEEDER_STALE) if fresh.model else []
        names = frozenset(n for e in mine for n in e.models) or frozenset((fresh.model,))
        self.bill, used = None, 0
        key = None
        if fresh.owner != ANONYMOUS_OWNER:
            key = store.key_record(fresh.owner)
            period = key.period(now) if key is not None else None
            if period is not None:
                used = store.budget_spent(key.id, period.id)  # type: ignore[union-attr]
            if key is not None:
                self.bill = Bill(key.id, fresh.model, period.id if period else None,
                                 period.counter_ttl if period else 0)
        self.refusal = owner_refusal(fresh, key, names, used, now)
        self.slots_seen = learn_slots(self.slots_seen, loads)
        r = room(fresh.model, endpoints, loads, reports, now, s.reserve, self.slots_seen, self.feeder)
        others = len([f for f in feeders if f.token != self.token])
        allow = self.throttle.view(r, others + 1, len(self.inflight))
        log.debug("batch %s: room %d on %d endpoints as of %.2fs ago (%d queued), %d in flight (%d counted there), "
                  "allowance %d", self.batch_id, r.free, r.endpoints, now - r.at, r.queued, len(self.inflight), r.mine,
                  allow)
        if fresh.model:
            store.write_feeder(fresh.model, self.token, len(self.inflight), now)
        if now - self.last_progress >= PROGRESS_EVERY:
            self.last_progress = now
            self.progress = (self.progress + [[round(now, 3), fresh.done]])[-PROGRESS_KEEP:]
            store.update_batch(self.batch_id, progress=self.progress)
        return fresh

    # --- sending and recording -------------------------------------------------------------------------
    def _dispatch(self, pool: ThreadPoolExecutor, lines: Iterator[Request], b: BatchRecord, now: float) -> bool:
        """Send (or, when the owner may not run it, answer with an error) the next lines the allowance
        leaves room for. True when the file has no line left to send (retries aside)."""
        refused = 0
        while True:
            if self.refusal is not None:
                if refused >= REFUSED_PER_PASS:
                    return False  # the next view renews the lease, then on
                req = self._next(lines, now, due_only=False)
                if req is None:
                    return True
                code, message = self.refusal
                self._record(req[0], False, error_line(self.batch_id, req[0].index, req[0].custom_id, code, message))
                refused += 1
                continue
            if now < self.paused_until or not self.throttle.may_send(len(self.inflight)):
                return False
            req = self._next(lines, now, due_only=True)
            if req is None:
                return True
            r, tries = req
            fut = pool.submit(self.send_line, b.endpoint, r.body, f"{self.batch_id}-{r.index}",
                              deadline=deadline_header(b.expires_at, now), feeder=self.feeder)
            self.inflight[fut] = (r, tries)
            self.outcome.sent += 1

    def _next(self, lines: Iterator[Request], now: float, due_only: bool) -> tuple[Request, int] | None:
        if self.retries and (self.retries[0].due <= now or not due_only):
            r = heapq.heappop(self.retries)
            return r.req, r.tries
        try:
            return next(lines), 0
        except StopIteration:
            return None

    def _collect(self, timeout: float) -> None:
        if not self.inflight:
            time.sleep(timeout)
            return
        done, _ = wait(list(self.inflight), timeout=timeout, return_when=FIRST_COMPLETED)
        now = self.clock()
        for fut in done:
            req, tries = self.inflight.pop(fut)
            try:
                ans = fut.result()
            except Exception as e:  # noqa: BLE001 - a bug in sending must not lose the line
                ans = Answer(0, error=f"{type(e).__name__}: {e}")
            self._answered(req, tries, ans, now)

    def _answered(self, req: Request, tries: int, ans: Answer, now: float) -> None:
        counted = tries + 1
        verdict = judge(ans.status, ans.retry_after, counted, self.settings.retries, ans.error, ans.unreached)
        if isinstance(verdict, Keep):
            p, c = usage_of(ans.body) if verdict.ok else (0, 0)
            line = answer_line(self.batch_id, req.index, req.custom_id, ans.status, ans.request_id, ans.body)
            self._record(req, verdict.ok, line, p, c)
        elif isinstance(verdict, GiveUp):
            self._record(req, False, error_line(self.batch_id, req.index, req.custom_id, verdict.code, verdict.message))
        elif isinstance(verdict, Again):
            if verdict.reason == "unauthorized":
                self._ensure_credential()
            if not verdict.counted:
                counted = tries  # a shed line waits its turn: its tries are not used up
            if verdict.reason == "shed":
                self.throttle.shed(len(self.inflight))  # no more in flight than now until the next view
            elif not verdict.counted:
                self.paused_until = max(self.paused_until, now + verdict.after)  # no gateway, or no replica
            heapq.heappush(self.retries, Retry(now + verdict.after, req.index, req, counted))

    def _record(self, req: Request, ok: bool, line: str, prompt: int = 0, completion: int = 0) -> None:
        n = self.store.record_line(self.batch_id, req.index, ok, line, prompt, completion,
                                   self.bill if ok or prompt or completion else None)
        if n == 1:
            self.outcome.recorded += 1

    def _ensure_credential(self) -> None:
        try:
            self.store.ensure_batch_credential()
        except RedisError as e:
            log.warning("batch %s: could not make the batch workers' key: %s", self.batch_id, e)

    def _drain_quietly(self) -> None:
        """Leaving (a slice ended, the lease was lost, a failure): let the lines in flight end and keep
        their answers, for as long as `drain_seconds` allows; the next run sends what is left."""
        deadline = self.clock() + self.settings.drain_seconds
        try:
            while self.inflight and self.clock() < deadline:
                self._collect(0.2)
        except RedisError as e:
            log.warning("batch %s: could not record the last answers (%s); the next run sends them again",
                        self.batch_id, e)

    # --- the end ---------------------------------------------------------------------------------------
    def _seal(self, b: BatchRecord, why: str, f: FileRecord | None) -> None:
        now = self.clock()
        if why == "expired":
            message = f"the batch's completion window ({b.completion_window}) ended before this request was answered"
            for req in self._unanswered(f, busy_too=True):  # a line still in flight is too late as well
                self.store.record_line(self.batch_id, req.index, False,
                                       error_line(self.batch_id, req.index, req.custom_id, "batch_expired", message))
        self.store.seal_batch(self.batch_id, sealed_at=now, sealed_as=why, finalizing_at=now)

    def _finish(self) -> None:
        """Make the sealed batch's files (their ids follow from the batch's, so doing it again after a
        crash makes the same ones) and write its final status."""
        store = self.store
        b = store.batch(self.batch_id)
        if b is None or b.sealed_at is None or b.ended:
            return
        now = self.clock()
        facts: dict = {}
        for kind, n, size, attr in (("output", b.n_completed, b.out_bytes, "output_file_id"),
                                    ("error", b.n_failed, b.err_bytes, "error_file_id")):
            if n:
                fid = output_file_id(b.id, kind)
                store.create_batch_file(FileRecord(
                    id=fid, owner=b.owner, filename=f"{b.id}_{kind}.jsonl", purpose="batch_output", bytes=size,
                    created_at=now, requests=n, batch_id=b.id, kind=kind, endpoint=b.endpoint, model=b.model))
                facts[attr] = fid
        status = b.sealed_as or "completed"
        facts[{"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status]] = now
        store.finish_batch(self.batch_id, status, **facts)
        log.info("batch %s %s: %d answered, %d failed of %d", b.id, b.sealed_as or "completed", b.n_completed,
                 b.n_failed, b.total)


def feeder_id(token: str) -> str:
    """The id a run's lines carry to the gateways (X-LLMGW-Feeder): its own (a run that takes over
    a batch is another feeder, the lines of one that died are not its), and not its lease's token."""
    return "f-" + hashlib.sha256(token.encode()).hexdigest()[:16]


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: the same whichever run makes it."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def run_batch(store: Store, settings: BatchSettings, send_line, batch_id: str, token: str,
              kick_run: Callable[[str], None], clock: Callable[[], float] = time.time) -> Outcome:
    """One run of `batch_id` (the task's body)."""
    return Run(store, settings, send_line, batch_id, token, kick_run, clock).run()
