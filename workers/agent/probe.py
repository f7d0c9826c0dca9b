"""HTTP probes of engines: `/health` for supervision and `/metrics` for load, with short timeouts.

Proxies from the environment are ignored on purpose: engines are reached directly, and an
`http_proxy` meant for downloads must not swallow health checks.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    error: str | None = None


def _describe(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    if isinstance(e, urllib.error.URLError):
        reason = e.reason
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused"
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return "timed out"
        return str(reason)
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(e).__name__}: {e}"


class HttpProber:
    """The real seam: GETs over HTTP. Tests pass a fake with the same two methods."""

    def health(self, url: str, timeout: float) -> ProbeResult:
        try:
            with _OPENER.open(url, timeout=timeout) as resp:
                resp.read(4096)
                return ProbeResult(200 <= resp.status < 300, None if resp.status < 300 else f"HTTP {resp.status}")
        except Exception as e:  # noqa: BLE001 - every failure is a failed probe, described
            return ProbeResult(False, _describe(e))

    def get(self, url: str, timeout: float, limit: int = 1024 * 1024, secret: str | None = None) -> tuple[int, bytes]:
        """Status and body of a GET, error statuses included (their body is not read); raises OSError
        (with a short description) when no answer came. `secret`: sent as a bearer token."""
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {secret}"} if secret else {})
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return resp.status, resp.read(limit)
        except urllib.error.HTTPError as e:
            e.close()
            return e.code, b""
        except Exception as e:  # noqa: BLE001
            raise OSError(_describe(e)) from e

    def fetch(self, url: str, timeout: float, limit: int = 4 * 1024 * 1024, secret: str | None = None) -> str:
        """The body as text; raises OSError (with a short description) on any failure. `secret`: the
        engine's credential, sent as a bearer token (llama-server guards /metrics with it)."""
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {secret}"} if secret else {})
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return resp.read(limit).decode("utf-8", errors="replace")
        except Exception as e:  # noqa: BLE001
            raise OSError(_describe(e)) from e


class HealthProbes:
    """The `/health` probes of one agent pass, run concurrently: a hung engine costs the pass one
    timeout, not one per replica."""

    def __init__(self, prober: Any, timeout: float, workers: int = 4):
        self.prober, self.timeout = prober, timeout
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmgw-probe")

    def run(self, urls: list[str]) -> list[ProbeResult]:
        """Each url's result, in order."""
        return list(self._pool.map(lambda url: self.prober.health(url, self.timeout), urls))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
