"""The download phase of a part whose source is remote (hf://, https://): its weights are made local
before its engine starts, so the engine's start timeout counts from there (docs/weights.md).

`fetch_step` is the rule for a part that needs its weights: ask the node's fetcher for them (after
the backoff of a failed try), record how far the download is (at most once a pass, only what
changed), and once they are local record where, so the usual start follows with that path. A
failed download is a failure like an engine's exit: the same streak, the same backoff."""

from __future__ import annotations

import logging

from llmgw.state.records import ReplicaRecord
from workers.agent.supervisor.actions import (
    Action,
    CancelFetch,
    FetchWeights,
    WeightsFailed,
    WeightsLocal,
    WeightsProgress,
)
from workers.agent.supervisor.observed import Observed
from workers.agent.supervisor.policy import Policy, next_failure

MILESTONES = (25, 50, 75)  # percent: an event each time a download passes one
_PROGRESS = ("weights_phase", "weights_done", "weights_total", "weights_rate", "weights_eta", "weights_file")


def needs_weights(rec: ReplicaRecord, obs: Observed) -> bool:
    """The part loads a remote source that is not local on this node yet."""
    return obs.weights_source is not None and (rec.weights_local_at is None or rec.weights_source != obs.weights_source)


def fetch_step(rec: ReplicaRecord, obs: Observed, now: float, policy: Policy) -> list[Action]:
    rid, f, source = rec.id, obs.fetch, obs.weights_source
    assert source is not None
    if f is None:
        if rec.next_restart_at is not None and now < rec.next_restart_at:
            return []  # the backoff after a failed try (or an engine exit)
        fields = {"weights_source": source, "weights_phase": "queued", "weights_started_at": now,
                  "weights_rate": None, "weights_eta": None, "weights_local_at": None, "weights_path": None}
        return [FetchWeights(rid, source, obs.weights_layout or "", fields=fields, message=f"making {source} local")]
    if f.phase == "failed":
        kind, reason = f.kind or "error", f.reason or "no reason given"
        failures, next_at = next_failure(rec.failure_times, now, policy)
        fields = {"weights_phase": "failed", "weights_error_kind": kind, "weights_error": reason,
                  "weights_failed_at": now, "weights_rate": None, "weights_eta": None,
                  "failure_times": list(failures), "next_restart_at": next_at}
        return [WeightsFailed(rid, kind, reason, next_at, fields=fields, level=logging.WARNING,
                              message=f"download of {source} failed ({kind}): {reason}; next try in "
                                      f"{max(0.0, next_at - now):.1f}s"),
                CancelFetch(rid)]
    if f.phase == "complete":
        fields = {"weights_phase": "complete", "weights_local_at": now, "weights_path": f.path,
                  "weights_done": f.done, "weights_total": f.total, "weights_rate": None, "weights_eta": None,
                  "weights_file": None}
        return [WeightsLocal(rid, f.path or "", f.done, f.fetched, f.seconds, fields=fields,
                             message=f"{source} is local at {f.path}"),
                CancelFetch(rid)]
    now_fields = dict(zip(_PROGRESS, (f.phase, f.done, f.total, f.rate, f.eta, f.file or None)))
    changed = {k: v for k, v in now_fields.items() if getattr(rec, k) != v}
    if not changed:
        return []
    return [WeightsProgress(rid, passed(rec.weights_done, rec.weights_total, f.done, f.total), fields=changed)]


def passed(before: int, before_total: int | None, done: int, total: int | None) -> int | None:
    """The highest milestone a download passed between two readings, if any."""
    if not total:
        return None
    was = 100 * before / before_total if before_total else 0.0
    now = 100 * done / total
    hits = [m for m in MILESTONES if was < m <= now]
    return hits[-1] if hits else None
