"""The reconciler's knobs (seconds). See docs/control-plane.md."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.state.replica_state import CrashPolicy
from workers.control.publish import LOST_GRACE


@dataclass(frozen=True)
class PlanConfig:
    launch_redispatch_after: float = 5.0
    stop_redispatch_after: float = 10.0
    lost_delete_after: float = 60.0  # a Lost record that was asked to stop is deleted after this
    # A Lost replica is asked to stop this long after its node's last heartbeat (replacement Ready or
    # not); it stays routable until then unless the gateways fail to reach it (publish.routable).
    lost_grace: float = LOST_GRACE
    crash_policy: CrashPolicy = field(default_factory=CrashPolicy)
