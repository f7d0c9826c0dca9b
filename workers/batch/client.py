"""Sending one batch line to a gateway: a plain HTTP POST at the lowest priority, with the batch
workers' own key when the gateway requires one. One keep-alive session per thread."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

import requests
from urllib3.exceptions import NewConnectionError

PRIORITY_HEADER = "X-LLMGW-Priority"
DEADLINE_HEADER = "X-LLMGW-Deadline"  # what is left of the batch's completion window (llmgw.slo)
# Which feeder sent the line: the gateways count each feeder's lines in their reports (GatewayReport.feeders).
FEEDER_HEADER = "X-LLMGW-Feeder"


def deadline_header(expires_at: float, now: float) -> str | None:
    """A line's deadline, from its batch's completion window: the seconds left of it (None: none left;
    the window's end expires the line anyway). Whole milliseconds, as the gateway reads a duration."""
    left = expires_at - now
    return f"{max(1, int(left * 1000))}ms" if left > 0 else None


@dataclass(frozen=True)
class Answer:
    status: int  # 0: no answer (`error` says why)
    body: Any = None  # the JSON answer, or its text when it was not JSON
    retry_after: float | None = None
    request_id: str = ""
    error: str = ""
    unreached: bool = False  # no connection was made: the line never reached a gateway


class LineSender:
    """`sender(path, body, request_id, deadline, feeder) -> Answer`. `credential()` is the key to send
    (None: none)."""

    def __init__(self, base_url: str, timeout: float, credential: Callable[[], str | None]):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.credential = credential
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def __call__(self, path: str, body: dict, request_id: str, deadline: str | None = None,
                 feeder: str | None = None) -> Answer:
        headers = {"Content-Type": "application/json", PRIORITY_HEADER: "batch", "X-Request-Id": request_id}
        if deadline is not None:
            headers[DEADLINE_HEADER] = deadline
        if feeder:
            headers[FEEDER_HEADER] = feeder
        key = self.credential()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            r = self._session().post(self.base_url + path, data=json.dumps(body), headers=headers,
                                     timeout=(5.0, self.timeout))
        except requests.ConnectTimeout as e:
            return Answer(0, error=f"ConnectTimeout: {e}", unreached=True)
        except requests.ConnectionError as e:
            # No connection made (refused: a gateway restarting) is unreached; a reset mid-answer is not.
            reason = getattr(e.args[0], "reason", None) if e.args else None
            return Answer(0, error=f"{type(e).__name__}: {e}", unreached=isinstance(reason, NewConnectionError))
        except requests.RequestException as e:
            return Answer(0, error=f"{type(e).__name__}: {e}")
        try:
            parsed: Any = r.json()
        except ValueError:
            parsed = r.text
        retry = r.headers.get("Retry-After")
        try:
            after = float(retry) if retry is not None else None
        except ValueError:
            after = None
        return Answer(r.status_code, parsed, after, r.headers.get("X-Request-Id", request_id))

    def close(self) -> None:
        s = getattr(self._local, "session", None)
        if s is not None:
            s.close()
