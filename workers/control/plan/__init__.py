"""The reconciler's brain: `plan(catalog, snapshot, now) -> list[Action]`. Pure: no Redis, no clock.

One pass compares, per catalog profile, the replicas wanted with the records that exist, and returns
the actions that move the fleet one step closer (docs/control-plane.md has the full rule set):

- start missing replicas, stop surplus ones (not yet Ready first, then the newest);
- replicas on a node whose heartbeat expired are Lost: unpublished and replaced at once, but asked to
  stop only once the replacements are Ready or the node has been gone `lost_grace` (so a heartbeat
  blip or a slow agent restart re-adopts them); a Lost record asked to stop is deleted after a grace;
- a crash-looping replica is moved when another eligible node can take it (the agent restarts a
  merely Failed one in place, with backoff);
- replicas of a model or profile that left the catalog are stopped;
- a replica whose spec changed, whose engine credentials were rotated (`llmgw engines
  rotate-credentials`), or whose node is draining or no longer matches, is outdated and
  replaced by a rolling update with a surge of one: a new one starts, and an old one is stopped only
  once a new one is Ready, so the profile never drops to zero Ready replicas;
- Stopped records are deleted; launches and stops still unconfirmed after a while are re-dispatched
  (harmless: the agent is level-based), which repairs a crash between recording and dispatching.

An autoscaled profile wants the count its autoscaler decided (`snapshot.wanted`), a fixed one its
`replicas`. Placement happens last, over all profiles at once, highest `scheduling_priority` first
(then `priority`), so short capacity goes to the profiles that matter most; a GPU replica that still
cannot be placed may preempt replicas of a strictly lower `scheduling_priority` (workers.control.
preempt): they drain and stop like any planned stop, and it waits for them.

The phases, one module each: `survey` (per record), `profile` (per profile: stops and the
`requests` to place), `placing` (placement and preemption); `core.plan` runs them in order.
"""

from workers.control.plan.actions import (
    Action,
    CreateReplica,
    DeleteRecord,
    DispatchLaunch,
    DispatchStop,
    PlaceReplica,
    StopReplica,
    UpdatePending,
)
from workers.control.plan.config import PlanConfig
from workers.control.plan.core import plan
from workers.control.plan.ids import default_id_factory, slug
from llmgw.catalog.spec import legacy_spec_hash
from workers.control.plan.requests import Kind

__all__ = [
    "Action", "CreateReplica", "DeleteRecord", "DispatchLaunch", "DispatchStop", "PlaceReplica", "StopReplica",
    "UpdatePending", "PlanConfig", "plan", "default_id_factory", "slug", "legacy_spec_hash", "Kind",
]
