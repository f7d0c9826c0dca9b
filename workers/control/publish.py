"""What the gateway may route to, and the list's fingerprint. Pure.

`routable(...)` is the publish decision for one replica (docs/lifecycle.md): a Ready replica of a
model and profile still in the catalog, never one asked to stop; and a replica whose node agent is
gone (Lost) stays routable while it was Ready when last heard of, for at most `lost_grace`, and
only while the gateways' own evidence (their last success and last failure reaching it) does not
say it fails. The engines are the data plane: an agent that crashed or restarts must not take
healthy engines out of routing.

`endpoints_from(...)` builds the list (sorted by id) and `fingerprint(endpoints)` summarises it, so
the publish task writes (and bumps the version) only when something a router cares about changed.
`decide(...)` is the whole pass's decision over one `PublishView`: the list, whether to write it,
which stopping replicas to stamp with the version that no longer lists them, and whether the live
nodes changed (then a reconcile is kicked).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple
from urllib.parse import urlsplit

from llmgw.catalog import Catalog, Model, Profile
from llmgw.catalog.slo import endpoint_fields as slo_fields
from llmgw.catalog.spec import legacy_spec_hash, profile_spec_hash
from llmgw.engines import ENGINES
from llmgw.state.demand_records import GatewayReport
from llmgw.state.node_records import NodeInfo
from llmgw.state.records import EndpointInfo, ReplicaRecord
from llmgw.state.replica_state import CrashPolicy, State, derive, nodes_alive, served_this_attempt
from llmgw.state.views import PublishView
from workers.control.adapterplacement import published_adapters

# How long a Lost node's Ready replicas stay routable without contrary evidence (seconds); the
# planner asks them to stop after the same time (PlanConfig.lost_grace).
LOST_GRACE = 300.0


@dataclass(frozen=True)
class Evidence:
    """What every gateway saw of one endpoint, merged: the latest success and the latest failure."""

    ok_at: float | None = None
    fail_at: float | None = None

    @property
    def failing(self) -> bool:
        """The latest word is a failure (a success since would have cleared it)."""
        return self.fail_at is not None and (self.ok_at is None or self.fail_at > self.ok_at)


def merge_evidence(reports: Iterable[GatewayReport]) -> dict[str, Evidence]:
    out: dict[str, Evidence] = {}
    for g in reports:
        for eid, use in g.endpoints.items():
            e = out.get(eid, Evidence())
            out[eid] = Evidence(_latest(e.ok_at, use.ok_at), _latest(e.fail_at, use.fail_at))
    return out


def _latest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def lost_since(rec: ReplicaRecord, live: Mapping[str, object], last_seen: Mapping[str, float]) -> float:
    """When a Lost replica's first node went quiet: that node's last heartbeat, or (for a node with no
    recorded heartbeat time) the latest fact in the record."""
    seen = [last_seen[n] for n in rec.all_nodes if n not in live and n in last_seen]
    if seen:
        return min(seen)
    facts = (rec.created_at, rec.launch_dispatched_at, rec.started_at, rec.last_probe_at, rec.adopted_at)
    return max((t for t in facts if t is not None), default=0.0)


class Routable(NamedTuple):
    """The publish decision for one replica: may the gateways route to it, and why (`llmgw status`)."""

    ok: bool
    why: str


def routable(rec: ReplicaRecord, node_alive: bool, lost_at: float, evidence: Evidence | None, now: float,
             policy: CrashPolicy = CrashPolicy(), lost_grace: float = LOST_GRACE) -> Routable:
    """May the gateways route to this replica? (yes/no, and why, for `llmgw status`). The caller has
    checked that its model and profile are in the catalog."""
    if rec.stop_requested_at is not None:
        return Routable(False, "stop requested")
    if not rec.url:
        return Routable(False, "no URL yet")
    if node_alive:
        view = derive(rec, True, now, policy)
        return Routable(view.state is State.READY, view.state.value)
    if not (served_this_attempt(rec) and rec.last_probe_ok):
        return Routable(False, "node lost while it was not Ready")
    gone = now - lost_at
    if gone >= lost_grace:
        return Routable(False, f"node agent lost {gone:.0f}s ago, longer than the {lost_grace:g}s grace")
    if evidence is not None and evidence.failing:
        return Routable(False, "node agent lost and gateways fail to reach the engine")
    return Routable(True, f"node agent lost {gone:.0f}s ago")


def endpoints_from(
    catalog: Catalog,
    replicas: Iterable[ReplicaRecord],
    live_nodes: Mapping[str, NodeInfo],
    now: float,
    policy: CrashPolicy = CrashPolicy(),
    *,
    last_seen: Mapping[str, float] | None = None,
    evidence: Mapping[str, Evidence] | None = None,
    lost_grace: float = LOST_GRACE,
) -> list[EndpointInfo]:
    out: list[EndpointInfo] = []
    models = {m.name: m for m in catalog.models}
    paths: dict[tuple[str, str], dict[str, str]] = {}  # what each profile's engine serves, asked once
    specs: dict[tuple[str, str], tuple[str, ...]] = {}  # each profile's current spec hashes (as the plan's)
    last_seen = last_seen or {}
    evidence = evidence or {}
    for rec in replicas:
        model = models.get(rec.model)
        if model is None:
            continue  # left the catalog: never routed to, even while its engine is still stopping
        profile = model.profile(rec.profile)
        if profile is None:
            continue
        alive = nodes_alive(rec, live_nodes)
        lost_at = now if alive else lost_since(rec, live_nodes, last_seen)
        if not routable(rec, alive, lost_at, evidence.get(rec.id), now, policy, lost_grace).ok:
            continue
        served = paths.get((model.name, profile.name))
        if served is None:
            served = paths[(model.name, profile.name)] = ENGINES[profile.engine].paths(profile)
        current = specs.get((model.name, profile.name))
        if current is None:
            current = specs[(model.name, profile.name)] = (profile_spec_hash(model, profile),
                                                           legacy_spec_hash(model, profile))
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
                engine_secret=rec.engine_secret or "",
                paths=served,
                adapters=published_adapters(rec, model, profile),
                adapter_slots=profile.lora.max_loras if profile.lora else 0,
                objective=(model.routing.objective or "") if model.routing else "",
                resume=model.routing.resume if model.routing else True,
                kv_tokens=profile.kv_cache_tokens,
                retiring=rec.spec_hash not in current,
                **slo_fields(model.slo),
                **kv_event_addresses(rec, model, profile),
            )
        )
    out.sort(key=lambda e: e.id)
    return out


def kv_event_addresses(rec: ReplicaRecord, model: Model, profile: Profile) -> dict[str, str]:
    """Where the gateways subscribe to a replica's KV events (its ports on the host of its url), and
    the tokenizer they match prompts with."""
    if not (profile.kv_events and rec.kv_events_port and rec.kv_replay_port):
        return {}
    host = urlsplit(rec.url).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return {"kv_events": f"tcp://{host}:{rec.kv_events_port}", "kv_replay": f"tcp://{host}:{rec.kv_replay_port}",
            "tokenizer": ENGINES[profile.engine].tokenizer_source(model, profile)}


def fingerprint(endpoints: Iterable[EndpointInfo]) -> str:
    """Stable digest of everything a router reads from the list (order-independent)."""
    docs = sorted((e.to_dict() for e in endpoints), key=lambda d: d["id"])
    blob = json.dumps(docs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Publish:
    """What one publish pass does."""

    endpoints: tuple[EndpointInfo, ...]  # every routable replica and Ready external url, by id
    fingerprint: str  # of the list and the catalog version
    changed: bool  # not the published list: write it as the next version
    unpublish: tuple[str, ...]  # asked to stop, not listed, not yet stamped: stamp the version in force
    live: frozenset[str]  # the live nodes now (what the process remembers for its next pass)
    lost: tuple[str, ...] = ()  # live at the process's last pass, not now
    returned: tuple[str, ...] = ()  # live now, not at its last pass

    @property
    def nodes_changed(self) -> bool:
        """A node joined or went quiet since the last pass: place or replace now (kick a reconcile)."""
        return bool(self.lost or self.returned)


def decide(catalog: Catalog, catalog_version: int, view: PublishView, now: float,
           externals: Iterable[EndpointInfo] = (), last_live: frozenset[str] | None = None,
           lost_grace: float = LOST_GRACE) -> Publish:
    """The publish pass's decision over one view. `externals`: the Ready urls of servers llmgw does
    not run (`external.external_endpoints` of the view's records); `last_live`: the live nodes at
    this process's last pass (None on its first, which compares with nothing)."""
    eps = endpoints_from(catalog, view.replicas, view.live, now, last_seen=view.last_seen,
                         evidence=merge_evidence(view.gateways), lost_grace=lost_grace)
    eps = sorted([*eps, *externals], key=lambda e: e.id)
    # The catalog version too: gateways re-read the catalog's names (which models exist, which can
    # cold-start) when the list's version moves, so a model added at zero replicas is known at once.
    fp = f"{fingerprint(eps)}@{catalog_version}"
    listed = {e.id for e in eps}
    unpublish = tuple(r.id for r in view.replicas
                      if r.stop_requested_at is not None and r.unpublished_version is None and r.id not in listed)
    live = frozenset(view.live)
    lost = returned = ()
    if last_live is not None:
        lost, returned = tuple(sorted(last_live - live)), tuple(sorted(live - last_live))
    return Publish(tuple(eps), fp, fp != view.fingerprint, unpublish, live, lost, returned)
