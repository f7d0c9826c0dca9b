"""What keeps a router's tables fresh in a gateway process: read from Redis in the background, never
per request (`Pollers`, which holds the router it feeds).

- the endpoint list: reloaded when `Store.endpoints_version()` changes (polled every
  LLMGW_GATEWAY_POLL_INTERVAL, woken early by the pub/sub hint), with the applied catalog's names;
- the loads: one MGET of the endpoints' LoadRecords every LLMGW_GATEWAY_LOAD_INTERVAL.

Each read is handed to the pure builders of gateway.routing (one read, one pure call, one swap). The
loops are threads; under gunicorn's gevent worker `threading` is monkey-patched, so each is a greenlet
and every wait in them yields to the request path. When Redis cannot be reached the last tables stay
in use (static stability).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Mapping

from gateway.config import GatewaySettings
from gateway.observe.health import REDIS_ERRORS, RedisHealth
from gateway.routing.router import Router
from gateway.routing.tables import tables_from
from llmgw.state.store import Store

log = logging.getLogger("llmgw.gateway")

FULL_RELOAD_EVERY = 30.0  # seconds


class Pollers:
    """The loops over one `router`: each read of Redis goes through `refresh_endpoints` or
    `refresh_loads` (tests call them directly), on the router's clock. `environ`: where the API keys of
    external servers are read from (`api_key_env` names a variable here); `on_loaded`: a new endpoint
    list is in use (report it)."""

    def __init__(self, store: Store, cfg: GatewaySettings, router: Router, health: RedisHealth | None = None,
                 environ: Mapping[str, str] | None = None, on_loaded: Callable[[], None] = lambda: None,
                 metrics=None):
        self.store, self.cfg, self.router, self.metrics = store, cfg, router, metrics
        self.clock = router.clock
        self.environ = os.environ if environ is None else environ
        self.health = health or RedisHealth(self.clock)
        self.on_loaded = on_loaded
        self._warned: set[tuple[str, str, str]] = set()
        self._last_full = float("-inf")
        self.wake = threading.Event()
        self.stopping = threading.Event()

    def refresh_endpoints(self, force: bool = False) -> bool:
        """Reload the endpoint list if its version changed; True if it did. Never raises."""
        # After an outage the counter may have restarted (Redis lost its data), and a long-lived
        # process re-reads now and then anyway: an equal version number is then not proof of equality.
        now = self.clock.monotonic()
        force = force or not self.health.ok or now - self._last_full >= FULL_RELOAD_EVERY
        router = self.router
        try:
            version = self.store.endpoints_version()
            if version < router.tables.version:
                router.renumber(version)
            tables = router.tables
            if version == tables.version and not force and tables.loaded:
                self.health.succeeded()
                return False
            v, fp, eps = self.store.read_endpoints()
            outline = self.store.catalog_outline()
            self._warn_missing_keys(self.store.key_variables())
            self.health.succeeded()
            self._last_full = now
        except REDIS_ERRORS as e:
            self.health.failed(e)
            return False
        except (ValueError, TypeError, KeyError) as e:  # a malformed document: keep the last good list
            log.error("cannot read the endpoint list: %s", e)
            return False
        if v == 0 and tables.endpoints:
            # Redis came back empty (restarted without data): keep serving until it is republished.
            return False
        new_list = not (tables.loaded and v == tables.version and fp == tables.fingerprint)
        new = tables_from(v, fp, eps, outline, self.environ)
        self._warn_missing_keys([(e.model, e.profile, e.api_key_env) for e in eps if e.id in new.missing_keys])
        router.apply_tables(new, new_list)
        if not new_list:
            return False
        if self.metrics:
            self.metrics.endpoints_version.set(v)
            self.metrics.endpoints.set(len(eps))
        log.info("endpoint list version %d: %d endpoints", v, len(eps))
        self.on_loaded()  # (apply_tables woke the queues)
        return True

    def _warn_missing_keys(self, wanted: list[tuple[str, str, str]]) -> None:
        """Once per process and variable: a profile's key variable is not in this environment (its
        endpoints get 503s, never another endpoint's key). The value itself is never logged."""
        for model, profile, var in wanted:
            if not self.environ.get(var) and (model, profile, var) not in self._warned:
                self._warned.add((model, profile, var))
                log.warning("environment variable %s is not set: requests that only external profile %s/%s "
                            "could serve get 503 from this gateway until it is started with %s set",
                            var, model, profile, var)

    def refresh_loads(self) -> None:
        router = self.router
        ids = list(router.tables.by_id)
        if not ids:
            router.fold_answers()
            return
        try:
            loads = self.store.loads(ids)
            self.health.succeeded()
        except REDIS_ERRORS as e:
            self.health.failed(e)
            router.fold_answers()
            return
        except (ValueError, TypeError) as e:
            log.error("cannot read loads: %s", e)
            router.fold_answers()
            return
        router.apply_loads(loads)

    # --- the loops --------------------------------------------------------------------------------
    def start(self) -> list[threading.Thread]:
        """Start the background threads (daemon): endpoint poller, pub/sub listener, load refresher."""
        threads = [
            threading.Thread(target=self._poll_loop, name="llmgw-endpoints", daemon=True),
            threading.Thread(target=self._pubsub_loop, name="llmgw-pubsub", daemon=True),
            threading.Thread(target=self._load_loop, name="llmgw-loads", daemon=True),
        ]
        for t in threads:
            t.start()
        return threads

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def _poll_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.refresh_endpoints()
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("endpoint refresh failed")
            self.wake.wait(self.cfg.poll_interval)
            self.wake.clear()

    def _load_loop(self) -> None:
        while not self.stopping.wait(self.cfg.load_interval):
            try:
                self.refresh_loads()
            except Exception:  # noqa: BLE001
                log.exception("load refresh failed")

    def _pubsub_loop(self) -> None:
        while not self.stopping.is_set():
            ps = None
            try:
                ps = self.store.subscribe_endpoints()
                while not self.stopping.is_set():
                    if ps.get_message(timeout=1.0):
                        self.wake.set()
            except REDIS_ERRORS:
                pass  # the poller reports the outage; just retry quietly
            except Exception:  # noqa: BLE001
                log.exception("pub/sub listener failed")
            finally:
                if ps is not None:
                    try:
                        ps.close()
                    except Exception:  # noqa: BLE001
                        pass
            self.stopping.wait(1.0)
