"""Servers llmgw does not run (`engine: external`): their health checks, load and endpoints.

Every url of an external profile gets a stable endpoint id (`ext-<model>-<profile>-<hash of the url>`,
so reordering or adding urls keeps the others' ids, learned speeds and load) and a record of facts in
Redis (`ExternalRecord`): the last check, failures in a row, the last success. Pure decisions:
`targets(catalog)` lists the urls, `due` says which to check now, `assess` turns a check into the next
record, and `external_endpoints` lists the Ready ones (`derive_external`) for the publisher.

The shell, `external_once` (the `llmgw.external` beat task, every LLMGW_EXTERNAL_INTERVAL), under its
own lock: read the records, check the urls that are due and scrape the Ready ones' /metrics (when the
profile gives a mapping) in parallel with a short timeout, write the records and loads, and when a
url turns Ready or Unreachable emit an event and kick a publish. Checks carry no API key: the key is
the gateway's alone, so a 401/403 from `GET /v1/models` counts as an answer (the server is up).
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Protocol

from llmgw.catalog import Catalog, Profile
from llmgw.catalog.slo import endpoint_fields as slo_fields
from llmgw.engines import ENGINES
from llmgw.engines.external import ExternalDriver
from llmgw.engines.metrics import read_load
from llmgw.engines.modelcard import context_length
from llmgw.state import keys
from llmgw.state.kicks import PUBLISH, Kicker, disabled
from llmgw.state.records import EndpointInfo, ExternalRecord, LoadRecord
from llmgw.state.replica_state import State, derive_external
from llmgw.state.store import Store
from workers.control.plan import slug
from workers.control.snapshot import CatalogKeeper

log = logging.getLogger("llmgw.control")

DRIVER: ExternalDriver = ENGINES["external"]  # type: ignore[assignment]
# Answers of GET /v1/models that prove a server is up although it wants a key the check does not send.
AUTH_ANSWERS = (401, 403)


@dataclass(frozen=True)
class Target:
    """One external url of the catalog."""

    id: str
    model: str
    profile: Profile
    url: str  # without a trailing slash

    def health_url(self) -> str:
        return self.url + DRIVER.health_path(self.profile)


@dataclass(frozen=True)
class Check:
    """What one health check saw."""

    ok: bool
    error: str | None = None
    context_length: int | None = None


@dataclass(frozen=True)
class ExternalConfig:
    check_interval: float = 5.0
    timeout: float = 2.0
    unreachable_after: int = 3


class Http(Protocol):
    """The HTTP seam (workers.agent.probe.HttpProber; tests pass a fake)."""

    def get(self, url: str, timeout: float) -> tuple[int, bytes]: ...

    def fetch(self, url: str, timeout: float) -> str: ...


def external_id(model: str, profile: str, url: str) -> str:
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:6]
    return f"ext-{slug(model)}-{slug(profile)}-{digest}"


def targets(catalog: Catalog) -> list[Target]:
    return [Target(external_id(m.name, p.name, url), m.name, p, url.rstrip("/"))
            for m, p in catalog.profiles() if p.engine == "external" for url in p.urls]


def due(rec: ExternalRecord | None, now: float, interval: float) -> bool:
    return rec is None or rec.checked_at is None or now - rec.checked_at >= interval


def assess(old: ExternalRecord | None, target: Target, check: Check, now: float,
           unreachable_after: int) -> ExternalRecord:
    """The url's next record after `check`."""
    base = old if old is not None and old.url == target.url else None
    new = ExternalRecord(
        id=target.id, model=target.model, profile=target.profile.name, url=target.url,
        checked_at=now, ok=check.ok, error=None if check.ok else check.error,
        failures=0 if check.ok else (base.failures if base else 0) + 1,
        last_ok_at=now if check.ok else (base.last_ok_at if base else None),
        changed_at=base.changed_at if base else None, unreachable_after=unreachable_after,
        context_length=check.context_length or (base.context_length if base else None),
    )
    if derive_external(base).state is not derive_external(new).state:
        new = replace(new, changed_at=now)
    return new


def external_endpoints(catalog: Catalog, records: Iterable[ExternalRecord]) -> list[EndpointInfo]:
    """The Ready urls of the catalog's external profiles, as endpoints."""
    by_id = {r.id: r for r in records}
    out = []
    for t in targets(catalog):
        rec = by_id.get(t.id)
        if rec is None or rec.url != t.url or derive_external(rec).state is not State.READY:
            continue
        model, p = catalog.model(t.model), t.profile
        out.append(EndpointInfo(
            id=t.id, url=t.url, models=tuple(model.names), engine="external", weight=p.weight,
            priority=p.priority, capacity=p.capacity, served_name=p.served_name or model.name, model=model.name,
            profile=p.name, paths=DRIVER.paths(p), api_key_env=p.api_key_env,
            objective=(model.routing.objective or "") if model.routing else "", kv_tokens=p.kv_cache_tokens,
            **slo_fields(model.slo),
        ))
    return out


def check(target: Target, http: Http, timeout: float, want_context: bool) -> Check:
    """Health-check one url: its engine's health path (2xx), else GET /v1/models (2xx, or 401/403 from
    a server that wants a key). The context length comes from /v1/models while it is not known."""
    try:
        status, body = http.get(target.health_url(), timeout)
    except OSError as e:
        return Check(False, str(e) or type(e).__name__)
    models = DRIVER.health_path(target.profile) == "/v1/models"
    if not (200 <= status < 300 or (models and status in AUTH_ANSWERS)):
        return Check(False, f"HTTP {status} from {DRIVER.health_path(target.profile)}")
    ctx = None
    if want_context:
        if not models:
            try:
                status, body = http.get(target.url + "/v1/models", timeout)
            except OSError:
                status, body = 0, b""
        ctx = context_length(body) if 200 <= status < 300 else None
    return Check(True, None, ctx)


def scrape(target: Target, rec: ExternalRecord, http: Http, timeout: float, now: float) -> LoadRecord | None:
    """A LoadRecord for a Ready url: its /metrics through the profile's mapping when it has one (like a
    managed replica's), else only what is known without one (the context length), or None."""
    p = target.profile
    if p.metrics is None:
        if rec.context_length is None:
            return None
        return LoadRecord(replica_id=target.id, ts=now, ok=True, context_length=rec.context_length)
    try:
        load = read_load(http.fetch(target.url + "/metrics", timeout), DRIVER.metrics_engine(p), p)
    except Exception as e:  # noqa: BLE001 - any failure is a stale sample, described
        return LoadRecord(replica_id=target.id, ts=now, ok=False, error=str(e) or type(e).__name__,
                          context_length=rec.context_length)
    return LoadRecord(replica_id=target.id, ts=now, ok=True, running=load.running, waiting=load.waiting,
                      kv_usage=load.kv_usage, prompt_tokens_total=load.prompt_tokens_total,
                      generation_tokens_total=load.generation_tokens_total, context_length=rec.context_length)


def external_once(store: Store, http: Http, now: Callable[[], float], config: ExternalConfig = ExternalConfig(),
                  lock_ttl: float = 30.0, catalogs: CatalogKeeper | None = None,
                  kicker: Kicker | None = None, load_ttl: float = 10.0) -> dict[str, int] | None:
    """One pass; None when another holds the lock or no catalog was ever readable."""
    kicker = kicker or disabled()
    with store.lock(keys.EXTERNAL_LOCK, lock_ttl) as held:
        if not held:
            return None
        loaded = (catalogs or CatalogKeeper()).load(store)
        if loaded is None:
            return None
        wanted = targets(loaded.catalog)
        records = {r.id: r for r in store.external_records()}
        gone = [i for i in records if i not in {t.id for t in wanted}]
        store.delete_externals(gone)
        t = now()
        to_check = [x for x in wanted if due(records.get(x.id), t, config.check_interval)]
        to_scrape = [x for x in wanted if x.id in records and derive_external(records[x.id]).state is State.READY]
        checks, loads = _run(to_check, to_scrape, records, http, config.timeout, t)
        written = [assess(records.get(x.id), x, c, t, config.unreachable_after) for x, c in zip(to_check, checks)]
        store.write_externals(written)
        changed = _changes(records, written, t, store)
        for load in loads:
            if load is not None:
                store.write_load(load, ttl=load_ttl)
        if changed:
            kicker.kick(PUBLISH)  # in or out of routing at once, not at the next publish tick
        return {"checked": len(to_check), "scraped": len(to_scrape), "changed": changed, "removed": len(gone)}


def _run(to_check: list[Target], to_scrape: list[Target], records: Mapping[str, ExternalRecord], http: Http,
         timeout: float, now: float) -> tuple[list[Check], list[LoadRecord | None]]:
    """The checks and the scrapes, all at once: one slow server costs one timeout, not one each."""
    if not to_check and not to_scrape:
        return [], []
    with ThreadPoolExecutor(max_workers=min(16, len(to_check) + len(to_scrape))) as pool:
        checks = [pool.submit(check, x, http, timeout, records.get(x.id) is None
                              or records[x.id].context_length is None) for x in to_check]
        scrapes = [pool.submit(scrape, x, records[x.id], http, timeout, now) for x in to_scrape]
        return [f.result() for f in checks], [f.result() for f in scrapes]


def _changes(before: Mapping[str, ExternalRecord], after: list[ExternalRecord], now: float, store: Store) -> int:
    """Log and record an event for every url that turned Ready or Unreachable; how many did."""
    n = 0
    for rec in after:
        old, new = derive_external(before.get(rec.id)), derive_external(rec)
        if old.state is new.state or new.state is State.CHECKING:
            continue
        n += 1
        kind = "external_ready" if new.state is State.READY else "external_unreachable"
        log.info("external %s (%s/%s, %s): %s %s", rec.id, rec.model, rec.profile, rec.url, new.state.value,
                 new.reason)
        store.emit(kind, new.reason or f"{rec.url} answers", source="control", model=rec.model,
                   profile=rec.profile, replica=rec.id, ts=now, url=rec.url)
    return n
