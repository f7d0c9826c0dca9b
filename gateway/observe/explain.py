"""How this gateway process served the requests that ask to be explained (`X-LLMGW-Explain: 1`; the
console's playground always asks), for `GET /v1/llmgw/requests/{id}` and `llmgw explain REQUEST_ID`
(llmgw.state.served has the record and its sentences).

Nothing on the request path changes for it: `Explaining` wraps the process's tracing, and a request
that asks gets a `Recorder` as its trace, fed by the hooks every request already calls (a no-op method
each while tracing is off), passing them on to the real trace; `explained_wsgi` keeps the answer's
routing headers. A request that does not ask costs one dictionary lookup in each. When the request
ends the Recorder hands its record to the `ExplainLog`, which the background loop flushes to Redis
with the usage (gateway.server.background), and which answers for its own requests before then.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, MutableMapping

from llmgw.state.records import EndpointInfo
from llmgw.state.served import Served, recordable

ENVIRON_HEADER = "HTTP_X_LLMGW_EXPLAIN"
RECENT = 512  # records this process answers for from memory (the rest from Redis)
PENDING_MAX = 10_000  # records waiting for the flush; beyond, the oldest are dropped (Redis down)


class ExplainLog:
    """The records of this process's explained requests: those to flush, and the recent ones."""

    def __init__(self, recent: int = RECENT):
        self.lock = threading.Lock()
        self.pending: list[Served] = []
        self.recent: OrderedDict[str, Served] = OrderedDict()
        self.keep = recent

    def add(self, rec: Served) -> None:
        with self.lock:
            self.pending.append(rec)
            if len(self.pending) > PENDING_MAX:
                del self.pending[: len(self.pending) - PENDING_MAX]
            self.recent[rec.id] = rec
            self.recent.move_to_end(rec.id)
            while len(self.recent) > self.keep:
                self.recent.popitem(last=False)

    def take(self) -> list[Served]:
        with self.lock:
            out, self.pending = self.pending, []
        return out

    def get(self, rid: str) -> Served | None:
        with self.lock:
            return self.recent.get(rid)


class Recorder:
    """The trace of a request that asked to be explained: every hook is passed on to the real trace
    (`inner`) and written down; at the end (`finish`, `refused`) the record goes to the log."""

    on = False

    def __init__(self, inner, rid: str, route: str, log: ExplainLog, wall: Callable[[], float],
                 mono: Callable[[], float], endpoint: Callable[[str], EndpointInfo | None],
                 owner: Callable[[], tuple[str, str]] = lambda: ("", "")):
        self.inner, self.rid, self.route, self.log = inner, rid, route, log
        self.mono, self.endpoint, self.owner = mono, endpoint, owner
        self.on = inner.on
        self.ts, self.t0 = wall(), mono()
        self.model = ""
        self.steps: list[dict[str, Any]] = []
        self.first: float | None = None
        self.queued_at: float | None = None
        self.last: dict[str, str] = {}
        self.routing = self.header_endpoint = ""
        self.ended: tuple | None = None  # (status, completed, usage, error, seconds) once it ended
        self.headed = False  # the answer's head went out (explained_wsgi)
        self.done = False  # the record went to the log

    def _at(self) -> float:
        return round(self.mono() - self.t0, 4)

    # --- the trace's hooks (llmgw.tracing.request), passed on ----------------------------------------
    def identify(self, model: str, key_name: str | None, priority: str) -> None:
        self.model = model
        self.inner.identify(model, key_name, priority)

    def admitting(self, queue_len: int) -> None:
        self.inner.admitting(queue_len)

    def queued(self, position: int) -> None:
        self.queued_at = self.mono()
        self.steps.append({"kind": "queued", "position": position})
        self.inner.queued(position)

    def dequeued(self, outcome: str) -> None:
        waited = round(self.mono() - self.queued_at, 4) if self.queued_at is not None else None
        self.steps.append({"kind": "dequeued", "outcome": outcome, "waited": waited})
        self.inner.dequeued(outcome)

    def choice(self, endpoint_id: str, reason: str, saturated: bool) -> None:
        self.steps.append({"kind": "choice", "endpoint": endpoint_id, "reason": reason, "saturated": saturated})
        self.inner.choice(endpoint_id, reason, saturated)

    def admitted(self, decision: str) -> None:
        self.inner.admitted(decision)

    def attempt(self, n: int, endpoint_id: str, url: str) -> None:
        ep = self.endpoint(endpoint_id)
        self.last = {"endpoint": endpoint_id, "replica": endpoint_id, "node": ep.node if ep else "",
                     "engine": ep.engine if ep else ""}
        self.steps.append({"kind": "attempt", "n": n, **self.last, "at": self._at()})
        self.inner.attempt(n, endpoint_id, url)

    def attempt_failed(self, outcome: str, status: int | None, retried: bool) -> None:
        self.steps.append({"kind": "failed", "outcome": outcome, "status": status, "retried": retried})
        self.inner.attempt_failed(outcome, status, retried)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        self.inner.inject(headers)

    def first_byte(self) -> None:
        if self.first is None:
            self.first = self._at()
        self.inner.first_byte()

    def finish(self, status: int, completed: bool, usage: tuple[int, int] | None) -> None:
        self.inner.finish(status, completed, usage)
        self._end(status, completed, tuple(usage[:2]) if usage else None, "")

    def refused(self, status: int, kind: str, message: str) -> None:
        self.inner.refused(status, kind, message)
        self._end(status, False, None, f"{kind}: {message}")

    # --- the answer's headers (explained_wsgi) ------------------------------------------------------
    def answered(self, headers) -> None:
        """The answer's head goes out: a stream's before its end, a whole answer's or an error's after."""
        for name, value in headers:
            low = name.lower()
            if low == "x-llmgw-prefix":
                self.routing = value
            elif low == "x-llmgw-endpoint":
                self.header_endpoint = value
        self.headed = True
        if self.ended is not None:
            self._record()

    def _end(self, status: int, completed: bool, usage, error: str) -> None:
        if self.ended is not None:
            return
        self.ended = (status, completed, usage, error, self._at())
        if self.headed:
            self._record()

    def _record(self) -> None:
        """Both the end and the head are known: the record goes to the log, once."""
        if self.done:
            return
        self.done = True
        status, completed, usage, error, seconds = self.ended
        name, kid = self.owner()  # the key the client presented, if the gateway knows it
        self.log.add(Served(
            id=self.rid, ts=self.ts, route=self.route, model=self.model, key=name, key_id=kid, status=status, completed=completed, error=error,
            usage=usage, first_byte=self.first, seconds=seconds, steps=tuple(self.steps), routing=self.routing,
            header_endpoint=self.header_endpoint, served_by=dict(self.last) if not error else {}))


class Explaining:
    """The process's tracing (llmgw.tracing: Tracing or OFF), whose `request` gives a request that
    asks to be explained a Recorder over its trace."""

    def __init__(self, inner, log: ExplainLog, wall: Callable[[], float], mono: Callable[[], float],
                 endpoint: Callable[[str], EndpointInfo | None], key_of: Callable[[str], tuple[str, str]]):
        self.inner, self.log, self.wall, self.mono = inner, log, wall, mono
        self.endpoint, self.key_of = endpoint, key_of  # a presented key -> (its name, its id), or ("", "")

    def request(self, environ: dict, rid: str, method: str, route: str):
        trace = self.inner.request(environ, rid, method, route)
        if environ.get(ENVIRON_HEADER) is None or not recordable(rid):
            return trace
        auth = environ.get("HTTP_AUTHORIZATION", "")
        presented = auth[7:].strip() if auth[:7].lower() == "bearer " else environ.get("HTTP_API_KEY", "")
        return Recorder(trace, rid, route, self.log, self.wall, self.mono, self.endpoint,
                        lambda: self.key_of(presented) if presented else ("", ""))

    def __getattr__(self, name: str):  # span, start, record, shutdown: the tracing's own
        return getattr(self.inner, name)


def explained_wsgi(app):
    """The WSGI app, which for a request that asks to be explained gives its Recorder the answer's
    headers (its routing: X-LLMGW-Endpoint, X-LLMGW-Prefix). Such an answer's stream is written by
    the server's own WSGI path, not relayed to the socket directly (gateway.upstream.relay needs the
    server's own start_response): the playground's requests, not the fleet's."""

    def wsgi(environ, start_response):
        if environ.get(ENVIRON_HEADER) is None:
            return app(environ, start_response)

        def start(status, headers, exc_info=None):
            rec = environ.get("llmgw.trace")
            if isinstance(rec, Recorder):
                rec.answered(headers)
            return start_response(status, headers, exc_info) if exc_info is not None else \
                start_response(status, headers)

        return app(environ, start)

    return wsgi
