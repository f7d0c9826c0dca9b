"""The event history: one capped stream (`XADD llmgw:events MAXLEN ~ N`) every part appends to.

Appending never blocks or fails the action it describes: errors are swallowed (logged at debug), and a
write that describes itself queues its event on its own pipeline (`queue_event(pipe, ...)`), so the
fact and its event land together. The event type and the filters are `llmgw.state.events` (pure).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from llmgw.state import keys
from llmgw.state.events import MAX_EVENTS, Event, matching
from llmgw.state.store.base import Aggregate, compact, ms

log = logging.getLogger("llmgw.events")


def queue_event(r, kind: str, message: str = "", *, source: str = "", model: str = "", profile: str = "",
                node: str = "", replica: str = "", ts: float | None = None, maxlen: int = MAX_EVENTS,
                **data: Any) -> None:
    """Append one event; `r` is the client or a pipeline (then it is sent with the pipeline). Never raises."""
    try:
        fields = {"ts": repr(time.time() if ts is None else ts), "kind": kind, "source": source, "model": model,
                  "profile": profile, "node": node, "replica": replica, "message": message}
        if data:
            fields["data"] = compact(data, default=str)
        r.xadd(keys.EVENTS, {k: v for k, v in fields.items() if v != ""}, maxlen=maxlen, approximate=True)
    except Exception as e:  # noqa: BLE001 - an event must never fail the action it describes
        log.debug("event %s not recorded: %s", kind, e)


def _decode(entry_id: str, f: dict[str, str]) -> Event:
    try:
        data = json.loads(f["data"]) if f.get("data") else {}
    except ValueError:
        data = {}
    return Event(id=entry_id, ts=float(f.get("ts") or 0), kind=f.get("kind", ""), source=f.get("source", ""),
                 model=f.get("model", ""), profile=f.get("profile", ""), node=f.get("node", ""),
                 replica=f.get("replica", ""), message=f.get("message", ""), data=data)


class Events(Aggregate):
    def emit(self, kind: str, message: str = "", **fields) -> None:
        """Append to the event history (`queue_event` on the client); never raises."""
        queue_event(self.r, kind, message, **fields)

    def emit_limited(self, kind: str, message: str, *, subject: str, every: float, **fields) -> bool:
        """`emit`, unless an event of this kind about `subject` was written (by any process) in the
        last `every` seconds; True when written. Never raises."""
        try:
            if not self.r.set(keys.event_gate(kind, subject), "1", nx=True, px=ms(every)):
                return False
        except redis.RedisError:
            return False
        self.emit(kind, message, **fields)
        return True

    def read_events(self, *, after: str = "-", count: int = 1000, since: float | None = None) -> list[Event]:
        """Events in order, oldest first: those after the stream id `after` (exclusive; "-" = from the
        start), or from wall time `since`; at most `count`."""
        start = after if after == "-" else f"({after}"
        if since is not None and after == "-":
            start = f"{int(since * 1000)}-0"
        return [_decode(i, f) for i, f in self.r.xrange(keys.EVENTS, min=start, max="+", count=count)]

    def latest_events(self, count: int = 100, *, model: str | None = None, node: str | None = None,
                      kind: str | None = None, page: int = 1000) -> list[Event]:
        """The newest `count` events that pass `matching(model, node, kind)`, oldest first: pages back
        through the stream until it has them (or the stream's start)."""
        found: list[Event] = []
        end = "+"
        while len(found) < count:
            batch = self.r.xrevrange(keys.EVENTS, max=end, min="-", count=page if (model or node or kind) else count)
            if not batch:
                break
            found += matching((_decode(i, f) for i, f in batch), model=model, node=node, kind=kind)
            if len(batch) < page:
                break
            end = f"({batch[-1][0]}"
        return list(reversed(found[:count]))
