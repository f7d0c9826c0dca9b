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


@dataclass(frozen=True)
class Answer:
    status: int  # 0: no answer (`error` says why)
    body: Any = None  # the JSON answer, or its text when it was not JSON
    retry_after: float | None = None
    request_id: str = ""
    error: str = ""
    unreached: bool = False  # no connection was made: the line never reached a gateway


class LineSender:
    """`sender(path, body, request_id) -> Answer`. `credential()` is the key to send (None: none)."""

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

    def __call__(self, path: str, body: dict, request_id: str) -> Answer:
        headers = {"Content-Type": "application/json", PRIORITY_HEADER: "batch", "X-Request-Id": request_id}
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
