"""Load scraping: about every second, GET each Ready replica's `/metrics` and write a LoadRecord.

Runs in its own thread with a small pool and short timeouts, so a hung engine delays only its own
sample, never supervision. A failed scrape is written too (`ok=False` with the error): the router
then treats that replica's load as stale instead of trusting an old number. Each record also
carries the context length the engine's `GET /v1/models` reports (asked once per replica and url,
again every 30 s while it does not say), for the gateway's `/v1/models`.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

from llmgw.catalog import Profile
from llmgw.engines import get_engine
from llmgw.engines.metrics import read_load
from llmgw.engines.modelcard import context_length
from llmgw.state.records import LoadRecord, ReplicaRecord
from workers.agent.adapterkeeper import lora_fields
from workers.agent.launch import Launch
from workers.agent.supervisor import ready_this_attempt

log = logging.getLogger("llmgw.agent")

CONTEXT_RETRY = 30.0  # seconds before asking an engine that did not say its context length again


@dataclass(frozen=True)
class ScrapeTarget:
    replica_id: str
    url: str
    engine: str
    profile: Profile | None
    # The engine's credential: llama-server guards /metrics with it (vLLM and the sim do not).
    secret: str | None = field(default=None, repr=False)
    models_url: str = ""  # the engine's GET /v1/models


def scrape_targets(heads: list[ReplicaRecord], launches: Mapping[str, Launch | None]) -> list[ScrapeTarget]:
    """The replicas to scrape: Ready attempts this agent runs (its `launches`), draining ones included
    (their drain waits for the engine's own running and waiting counts to reach 0)."""
    targets = []
    for rec in heads:
        if rec.id not in launches or rec.drained_at is not None or rec.stopped_at is not None or not rec.url:
            continue
        if rec.running and ready_this_attempt(rec) and rec.last_probe_ok:
            launch = launches[rec.id]
            path = launch.spec.metrics_path if launch else "/metrics"
            targets.append(ScrapeTarget(rec.id, rec.url.rstrip("/") + path, launch.engine if launch else "",
                                        launch.profile if launch else None, rec.engine_secret,
                                        rec.url.rstrip("/") + "/v1/models"))
    return targets


LOAD_FIELDS = ("running", "waiting", "kv_usage", "prompt_tokens_total", "generation_tokens_total",
               "prefix_queries_total", "prefix_hits_total", "prefill_seconds_total",
               "prefill_tokens_total", "kv_tokens")
COUNT_FIELDS = frozenset({"kv_tokens"})  # whole numbers; the rest are floats


def _default_profile(engine: str) -> Profile:
    """A stand-in profile with nothing but the engine: its default metric names. Built without
    validation (a catalog's rules, such as vLLM needing a GPU class, are about profiles users write),
    so it can never be the reason a scrape fails."""
    return Profile.model_construct(name="default", engine=engine)


def map_load(text: str, engine: str, profile) -> dict:
    """The load numbers from a /metrics body, through llmgw.engines.metrics (the engines' mapping)."""
    if profile is None:  # the model left the catalog: the engine's default mapping still applies
        profile = _default_profile(engine)
    out = read_load(text, get_engine(engine), profile)
    if not isinstance(out, dict):
        out = {k: getattr(out, k, None) for k in
               LOAD_FIELDS}
    return out


def scrape_one(target, fetch: Callable[..., str], timeout: float, now: float,
               context: int | None = None) -> LoadRecord:
    try:
        text = fetch(target.url, timeout, secret=target.secret)
        values = map_load(text, target.engine, target.profile)
    except Exception as e:  # noqa: BLE001 - any failure is a stale sample, described
        return LoadRecord(replica_id=target.replica_id, ts=now, ok=False, error=str(e) or type(e).__name__,
                          context_length=context)
    known = LOAD_FIELDS
    return LoadRecord(replica_id=target.replica_id, ts=now, ok=True, context_length=context,
                      **{k: (None if v is None else int(v) if k in COUNT_FIELDS else float(v))
                         for k, v in values.items() if k in known},
                      **lora_fields(text, target.profile))


class Scraper:
    def __init__(self, store, prober, targets: Callable[[], list], settings, clock):
        self.store, self.prober, self.targets, self.settings, self.clock = store, prober, targets, settings, clock
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmgw-scrape")
        # (replica id, models url) -> its context length, or None with when to ask again
        self.contexts: dict[tuple[str, str], tuple[int | None, float]] = {}

    def context(self, target: ScrapeTarget) -> int | None:
        """The engine's context length, asked of its /v1/models once (again later while unknown)."""
        key = (target.replica_id, target.models_url)
        value, retry_at = self.contexts.get(key, (None, float("-inf")))
        if value is None and target.models_url and self.clock.monotonic() >= retry_at:
            try:
                value = context_length(self.prober.fetch(target.models_url, self.settings.scrape_timeout,
                                                         secret=target.secret))
            except OSError:
                value = None
            self.contexts[key] = (value, self.clock.monotonic() + CONTEXT_RETRY)
        return value

    def once(self) -> list[LoadRecord]:
        targets = list(self.targets())
        live = {(t.replica_id, t.models_url) for t in targets}
        self.contexts = {k: v for k, v in self.contexts.items() if k in live}
        if not targets:
            return []
        now = self.clock.time()
        records = list(self.pool.map(
            lambda t: scrape_one(t, self.prober.fetch, self.settings.scrape_timeout, now, self.context(t)), targets))
        ttl = max(10.0, 10 * self.settings.scrape_interval)
        for rec in records:
            self.store.write_load(rec, ttl=ttl)
        return records

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = self.clock.monotonic()
            try:
                self.once()
            except Exception:  # noqa: BLE001
                log.exception("load scrape failed")
            stop.wait(max(0.05, self.settings.scrape_interval - (self.clock.monotonic() - started)))
        self.pool.shutdown(wait=False)
