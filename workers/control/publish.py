"""What the gateway may route to: Ready replicas of models still in the catalog. Pure.

`endpoints_from(catalog, replicas, live_nodes, now)` builds the list (sorted by id) and
`fingerprint(endpoints)` summarises it, so the publish task writes (and bumps the version) only when
something a router cares about changed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Mapping

from llmgw.catalog import Catalog
from llmgw.state.records import EndpointInfo, NodeInfo, ReplicaRecord
from llmgw.state.replica_state import CrashPolicy, State, derive, nodes_alive


def endpoints_from(
    catalog: Catalog,
    replicas: Iterable[ReplicaRecord],
    live_nodes: Mapping[str, NodeInfo],
    now: float,
    policy: CrashPolicy = CrashPolicy(),
) -> list[EndpointInfo]:
    out: list[EndpointInfo] = []
    models = {m.name: m for m in catalog.models}
    for rec in replicas:
        model = models.get(rec.model)
        if model is None:
            continue  # left the catalog: never routed to, even while its engine is still stopping
        profile = model.profile(rec.profile)
        if profile is None or not rec.url:
            continue
        if derive(rec, nodes_alive(rec, live_nodes), now, policy).state is not State.READY:
            continue
        out.append(
            EndpointInfo(
                id=rec.id,
                url=rec.url.rstrip("/"),
                models=tuple(model.names),
                engine=profile.engine,
                pool=profile.pool,
                weight=profile.weight,
                priority=profile.priority,
                capacity=profile.capacity,
                served_name=model.name,
                model=model.name,
                profile=profile.name,
                node=rec.node or "",
            )
        )
    out.sort(key=lambda e: e.id)
    return out


def fingerprint(endpoints: Iterable[EndpointInfo]) -> str:
    """Stable digest of everything a router reads from the list (order-independent)."""
    docs = sorted((e.to_dict() for e in endpoints), key=lambda d: d["id"])
    blob = json.dumps(docs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
