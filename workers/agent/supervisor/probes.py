"""Health probes: which replicas to probe this pass (`due_probes`), and what one result means (`probed`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from llmgw.state.records import ReplicaRecord
from workers.agent.supervisor.actions import Probed
from workers.agent.supervisor.observed import Attempt, Observed
from workers.agent.supervisor.policy import Policy
from workers.agent.supervisor.rules import ready_this_attempt


def probed(rec: ReplicaRecord, failures_before: int, ok: bool, error: str | None, now: float,
           policy: Policy) -> Probed:
    """What one probe result means for the record: a Ready replica turns unhealthy only after
    `policy.probe_failures` failures in a row (one slow answer from a busy engine is not an outage,
    like kubelet's failureThreshold); the first success of an attempt is its `first_ready_at`; an
    unchanged result is rewritten only every `probe_refresh` seconds."""
    failures = 0 if ok else failures_before + 1
    ready = ready_this_attempt(rec)
    if not ok and ready and rec.last_probe_ok and failures < policy.probe_failures:
        return Probed(rec.id, ok, failures)
    fields: dict[str, Any] = {"last_probe_at": now, "last_probe_ok": ok, "probe_error": error}
    became_ready = ok and not ready
    if became_ready:
        fields["first_ready_at"] = now
    changed = rec.last_probe_ok != ok or rec.probe_error != error or became_ready
    if not changed and now - (rec.last_probe_at or 0) < policy.probe_refresh:
        return Probed(rec.id, ok, failures)
    message = f"ready at {rec.url} (attempt {rec.attempt})" if became_ready else ""
    return Probed(rec.id, ok, failures, became_ready, fields=fields, message=message)


@dataclass(frozen=True)
class Probe:
    """A `/health` probe to run this pass."""

    replica_id: str
    url: str
    failures: int = 0  # failed probes in a row before this one


def due_probes(views: Iterable[ReplicaRecord], observed: Mapping[str, Observed], memory: Mapping[str, Attempt],
               health_paths: Mapping[str, str], now: float, policy: Policy) -> list[Probe]:
    """The probes to run now: of running attempts this agent has a memory of that serve HTTP at a url
    and are not asked to stop, last probed at least their interval ago (a starting attempt's is short:
    the moment it answers is the moment it can be routed). `health_paths`: the engine's, per replica."""
    due = []
    for rec in views:
        obs, mem = observed.get(rec.id), memory.get(rec.id)
        if obs is None or mem is None or not obs.alive or not obs.has_health or rec.stop_requested_at is not None \
                or not rec.url:
            continue
        every = policy.probe_interval if ready_this_attempt(rec) else policy.start_probe_interval
        if mem.last_probe_at is not None and now - mem.last_probe_at < every:
            continue
        due.append(Probe(rec.id, rec.url.rstrip("/") + health_paths.get(rec.id, "/health"), mem.probe_failures))
    return due
