"""The event history: what happened to the fleet, in order (`llmgw events`, the console).

Writers (the control plane, the agents, the gateways) append to one capped Redis stream
(`XADD llmgw:events MAXLEN ~ N`). Appending never blocks or fails the action it describes: errors are
swallowed (logged at debug), and callers usually add the event to the pipeline of the write it
describes (`emit(pipe, ...)`), so the fact and its event land together.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from llmgw.state import keys

log = logging.getLogger("llmgw.events")

MAX_EVENTS = 10_000

# The kinds llmgw writes (docs/events.md lists what each carries).
KINDS = (
    "catalog_applied",
    "replica_placed", "replica_pending", "replica_ready", "replica_unhealthy", "replica_failed",
    "replica_restarted", "replica_crashloop", "replica_adopted", "replica_moved", "replica_draining",
    "replica_stopped", "replica_scaled", "replica_preempted",
    "node_joined", "node_lost", "node_cordoned", "node_uncordoned", "node_drained",
    "credentials_rotated",
    "endpoints_published", "external_ready", "external_unreachable",
    "model_saturated", "model_recovered", "model_cold_start",
)


@dataclass(frozen=True)
class Event:
    id: str  # the stream id, "<ms>-<seq>": orders events and pages through them
    ts: float
    kind: str
    source: str = ""  # control | agent:<node> | gateway:<host>
    model: str = ""
    profile: str = ""
    node: str = ""
    replica: str = ""
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "ts": self.ts, "kind": self.kind, "source": self.source, "model": self.model,
                "profile": self.profile, "node": self.node, "replica": self.replica, "message": self.message,
                "data": self.data}


def emit(r, kind: str, message: str = "", *, source: str = "", model: str = "", profile: str = "",
         node: str = "", replica: str = "", ts: float | None = None, maxlen: int = MAX_EVENTS, **data: Any) -> None:
    """Append one event. `r` is a client or a pipeline (then it is sent with the pipeline). Never raises."""
    try:
        fields = {"ts": repr(time.time() if ts is None else ts), "kind": kind, "source": source, "model": model,
                  "profile": profile, "node": node, "replica": replica, "message": message}
        if data:
            fields["data"] = json.dumps(data, separators=(",", ":"), default=str)
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


def read(r, *, after: str = "-", count: int = 1000, since: float | None = None) -> list[Event]:
    """Events in order, oldest first: those after the stream id `after` (exclusive; "-" = from the
    start), or from wall time `since`; at most `count`."""
    start = after if after == "-" else f"({after}"
    if since is not None and after == "-":
        start = f"{int(since * 1000)}-0"
    return [_decode(i, f) for i, f in r.xrange(keys.EVENTS, min=start, max="+", count=count)]


def latest(r, count: int = 100, *, model: str | None = None, node: str | None = None,
           kind: str | None = None, page: int = 1000) -> list[Event]:
    """The newest `count` events that pass `matching(model, node, kind)`, oldest first: pages back
    through the stream until it has them (or the stream's start)."""
    found: list[Event] = []
    end = "+"
    while len(found) < count:
        batch = r.xrevrange(keys.EVENTS, max=end, min="-", count=page if (model or node or kind) else count)
        if not batch:
            break
        found += matching((_decode(i, f) for i, f in batch), model=model, node=node, kind=kind)
        if len(batch) < page:
            break
        end = f"({batch[-1][0]}"
    return list(reversed(found[:count]))


def kind_problem(kind: str | None) -> str | None:
    """Why a kind filter can never match (a typo), or None."""
    if not kind:
        return None
    ok = any(k.startswith(kind[:-1]) for k in KINDS) if kind.endswith("*") else kind in KINDS
    return None if ok else f"no event kind {kind!r}; kinds: {', '.join(KINDS)}"


def matching(events: Iterable[Event], *, model: str | None = None, node: str | None = None,
             kind: str | None = None) -> list[Event]:
    """Filter (pure): by model (name), node and kind (exact, or a prefix ending in '*')."""
    out = []
    for e in events:
        if model and e.model != model:
            continue
        if node and e.node != node:
            continue
        if kind and not (e.kind.startswith(kind[:-1]) if kind.endswith("*") else e.kind == kind):
            continue
        out.append(e)
    return out
