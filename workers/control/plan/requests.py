"""The placements one pass attempts after deciding each profile (phase two of `plan`), and the order
they are attempted in."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from llmgw.catalog import Model, Profile
from llmgw.state.records import ReplicaRecord
from workers.control.placement import PlacementRequest


class Kind(IntEnum):
    """What a request places; within one profile's turn they go in this order."""

    MOVE = 0  # a crash-looping replica, to another node
    PENDING = 1  # a record that found no room before
    NEW = 2  # a replica the profile still lacks


class Order(NamedTuple):
    """Where a request stands in line. Priorities are negated, so a plain sort puts the highest first."""

    scheduling_priority: int
    priority: int
    ordinal: int  # the profile's n-th request: each profile gets its first replica before any its second
    kind: Kind
    model: str
    profile: str


def gpu_order(r: "Request") -> Order:
    """GPU requests compete for capacity: highest priority first, and within a priority the profiles
    take turns (first replicas, then second ones, ...)."""
    return r.order


def cpu_order(r: "Request") -> tuple:
    """CPU requests take no capacity (they are only spread): one profile after another, by priority."""
    o = r.order
    return (o.scheduling_priority, o.priority, o.model, o.profile, o.ordinal, o.kind)


@dataclass
class Request:
    """One placement to attempt in phase two."""

    order: Order
    kind: Kind
    model: Model
    profile: Profile
    spec_hash: str
    req: PlacementRequest
    rec: ReplicaRecord | None = None  # the record a MOVE or PENDING request is about
    why: str = ""
    count: int = 1  # NEW CPU requests come as one batch per profile
    credential_generation: int = 0  # stamped on the records it creates
