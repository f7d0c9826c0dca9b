"""What a reconcile pass decides: the actions `plan` returns, each a frozen dataclass the apply shell
(workers.control.apply) records and dispatches, and the one way every planned stop is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from llmgw.catalog import DRAIN_TIMEOUT
from llmgw.state.records import ReplicaRecord
from workers.control.placement import Placement, Refusal
from workers.control.snapshot import Snapshot


@dataclass(frozen=True)
class CreateReplica:
    """Record a new replica (placed, or Pending with a reason), then dispatch its launch if placed."""

    id: str
    model: str
    profile: str
    spec_hash: str
    placement: Placement | None
    pending_reason: str | None = None
    why: str = ""  # "scale up", "replaces r1 (node-a lost)", ...
    credential_generation: int = 0  # its model's, from the snapshot
    refusals: tuple[Refusal, ...] = ()  # when Pending: why each live node refused it
    moved_from: str | None = None  # the crash-looping replica this one replaces elsewhere
    adapters: tuple[str, ...] = ()  # the LoRA adapters it holds (llama.cpp: launches with), from the adapter step

    def record(self, now: float, engine_secret: str | None = None) -> ReplicaRecord:
        """The control fields of the new record; `launch_dispatched_at` marks the intent to launch.
        The secret comes from the applying shell (decisions take no randomness)."""
        p = self.placement
        return ReplicaRecord(
            id=self.id,
            model=self.model,
            profile=self.profile,
            spec_hash=self.spec_hash,
            node=p.head if p else None,
            nodes=list(p.nodes) if p else [],
            gpus=p.gpus_dict() if p else {},
            created_at=now,
            pending_reason=None if p else self.pending_reason,
            pending_refusals=[] if p else [r.to_dict() for r in self.refusals],
            launch_dispatched_at=now if p else None,
            engine_secret=engine_secret,
            credential_generation=self.credential_generation,
            adapters_wanted=list(self.adapters),
        )


@dataclass(frozen=True)
class PlaceReplica:
    """A Pending record found room: write its node and GPUs, then dispatch its launch."""

    id: str
    placement: Placement
    model: str = ""  # for the event history
    profile: str = ""

    def fields(self, now: float) -> dict:
        """The control fields it writes; `launch_dispatched_at` marks the intent to launch."""
        p = self.placement
        return {"node": p.head, "nodes": list(p.nodes), "gpus": p.gpus_dict(), "pending_reason": None,
                "pending_refusals": [], "launch_dispatched_at": now}


@dataclass(frozen=True)
class UpdatePending:
    """A Pending record still has no room, for a different reason (or other node refusals) than the
    ones it shows."""

    id: str
    reason: str
    refusals: tuple[Refusal, ...] = ()

    def fields(self) -> dict:
        return {"pending_reason": self.reason, "pending_refusals": [r.to_dict() for r in self.refusals]}


@dataclass(frozen=True)
class StopReplica:
    """Record the stop request (time and reason), then dispatch `llmgw.stop` to its nodes."""

    id: str
    reason: str
    nodes: tuple[str, ...] = ()
    dispatch: bool = True  # False when its nodes are not live: nobody would consume it now
    drain_timeout: float = 0.0  # the profile's: how long in-flight requests may take to finish
    model: str = ""  # for the event history
    event: str = "replica_draining"  # "replica_preempted" when it makes room for a higher scheduling_priority


@dataclass(frozen=True)
class DeleteRecord:
    id: str
    reason: str = ""


@dataclass(frozen=True)
class DispatchLaunch:
    """Send the launch again: still Launching a while after the last dispatch."""

    id: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class DispatchStop:
    """Send the stop again: still Stopping a while after it was requested."""

    id: str
    nodes: tuple[str, ...]


Action = Union[CreateReplica, PlaceReplica, UpdatePending, StopReplica, DeleteRecord, DispatchLaunch, DispatchStop]


def rec_nodes(rec: ReplicaRecord) -> tuple[str, ...]:
    return tuple(rec.all_nodes)


def planned_stop(rec: ReplicaRecord, reason: str, snap: Snapshot, drain_timeout: float = DRAIN_TIMEOUT,
                 event: str = "replica_draining") -> Action:
    """Every planned stop: the agent drains it (docs/lifecycle.md) for up to `drain_timeout`."""
    if rec.node is None:  # never placed: nothing runs, nothing to tell an agent
        return DeleteRecord(rec.id, reason)
    nodes = rec_nodes(rec)
    return StopReplica(rec.id, reason, nodes, dispatch=all(n in snap.nodes for n in nodes),
                       drain_timeout=drain_timeout, model=rec.model, event=event)
