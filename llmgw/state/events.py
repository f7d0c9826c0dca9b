"""The event history: what happened to the fleet, in order (`llmgw events`, the console).

The event type, the kinds llmgw writes and the filters, all pure. Writers (the control plane, the
agents, the gateways) append through the store (`Store.emit`), readers read through it
(`Store.read_events`, `Store.latest_events`): `llmgw.state.store.events` owns the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

MAX_EVENTS = 10_000

# The kinds llmgw writes (docs/events.md lists what each carries).
KINDS = (
    "catalog_applied",
    "replica_placed", "replica_pending", "replica_ready", "replica_unhealthy", "replica_failed",
    "replica_restarted", "replica_crashloop", "replica_adopted", "replica_moved", "replica_draining",
    "replica_stopped", "replica_scaled", "replica_preempted",
    "node_joined", "node_lost", "node_cordoned", "node_uncordoned", "node_drained",
    "credentials_rotated",
    "key_created", "key_updated", "key_revoked",
    "endpoints_published", "external_ready", "external_unreachable",
    "model_saturated", "model_recovered", "model_cold_start", "stream_resumed",
    "weights_download_started", "weights_download_progress", "weights_download_failed", "weights_download_complete",
    "weights_evicted", "gpu_unhealthy", "gpu_healthy",
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


def published_message(count: int) -> str:
    """The words of an `endpoints_published` event. An empty list is published too (a catalog applied
    before any replica is Ready: the new version tells the gateways its model names), which is no
    failure: say what it means."""
    if count == 0:
        return "0 endpoints: no replica is Ready to route to (the gateways learn the catalog's names from it)"
    return f"{count} endpoint{'s' if count != 1 else ''}"


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

