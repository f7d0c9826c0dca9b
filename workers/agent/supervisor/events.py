"""What an applied action tells the rest of llmgw: events for the history and control passes to kick."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.proc.exitstatus import describe_exit
from llmgw.state.kicks import PUBLISH, RECONCILE
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import CrashPolicy
from workers.agent.supervisor.actions import (
    Action,
    Adopt,
    FetchWeights,
    LaunchFailed,
    MarkStopped,
    Probed,
    RecordExit,
    Start,
    WeightsFailed,
    WeightsLocal,
    WeightsProgress,
)
from workers.agent.supervisor.rules import ready_this_attempt


@dataclass(frozen=True)
class News:
    """An event for the history (`llmgw.state.events`) and the control passes to kick at once."""

    kind: str
    message: str
    kicks: tuple[str, ...] = ()


def news(rec: ReplicaRecord, action: Action, crash: CrashPolicy = CrashPolicy()) -> list[News]:
    """What an applied action tells the rest of llmgw (`rec`: the part's view before the action). A
    replica turning Ready or unhealthy changes what is routable (publish now); an exit, a failed
    launch or a confirmed stop changes what should run (reconcile now: restart elsewhere, delete the
    record, place what waited for its GPUs)."""
    if isinstance(action, Probed):
        if action.became_ready:
            return [News("replica_ready", f"Ready at {rec.url} (attempt {rec.attempt})", (PUBLISH,))]
        if "last_probe_ok" in action.fields and action.fields["last_probe_ok"] != rec.last_probe_ok \
                and ready_this_attempt(rec):
            if action.ok:
                return [News("replica_ready", "healthy again", (PUBLISH,))]
            return [News("replica_unhealthy", action.fields.get("probe_error") or "health probe failing", (PUBLISH,))]
        return []
    if isinstance(action, RecordExit):
        how = describe_exit(action.exit.exit_code, action.exit.exit_signal)
        how += (f" ({action.reason})" if action.reason else "") + (f"; engine log: {rec.log_path}" if rec.log_path else "")
        out = [News("replica_failed", f"attempt {rec.attempt} {how}", (PUBLISH, RECONCILE))]
        recent = sum(1 for t in action.failure_times if action.exit.exited_at - t <= crash.window)
        if recent >= crash.max_failures:
            out.append(News("replica_crashloop", f"{recent} failures in {crash.window:g}s; last {how}"))
        return out
    if isinstance(action, LaunchFailed):
        return [News("replica_failed", f"attempt {action.attempt} could not start: {action.reason}", (RECONCILE,))]
    if isinstance(action, Start) and action.restart:
        return [News("replica_restarted", f"attempt {action.attempt}")]
    if isinstance(action, MarkStopped):
        return [News("replica_stopped", rec.stop_reason or "stopped", (RECONCILE,))]
    if isinstance(action, Adopt):
        return [News("replica_adopted", f"attempt {rec.attempt} adopted by a restarted agent (pid {action.pid})")]
    return _weights_news(rec, action)


def _weights_news(rec: ReplicaRecord, action: Action) -> list[News]:
    """A download's start, its 25/50/75 % marks, its failure (reconcile: a crash loop may move the
    replica) and its completion."""
    if isinstance(action, FetchWeights):
        resume = f", resuming from {_size(rec.weights_done)} on disk" if rec.weights_done else ""
        return [News("weights_download_started", f"downloading {action.source}{resume}")]
    if isinstance(action, WeightsProgress) and action.milestone is not None:
        total = action.fields.get("weights_total", rec.weights_total)
        return [News("weights_download_progress", f"{action.milestone}% of {_size(total)} ({rec.weights_source})")]
    if isinstance(action, WeightsFailed):
        return [News("weights_download_failed", f"{rec.weights_source}: {action.kind}: {action.reason}",
                     (RECONCILE,))]
    if isinstance(action, WeightsLocal):
        if not action.fetched:
            return [News("weights_download_complete", f"{rec.weights_source}: {_size(action.size)} already on the node")]
        rate = action.fetched / action.seconds / 1024 ** 2 if action.seconds > 0 else 0.0
        return [News("weights_download_complete", f"{rec.weights_source}: {_size(action.fetched)} in "
                                                   f"{action.seconds:.1f}s ({rate:.1f} MiB/s) to {action.path}")]
    return []


def _size(n: float | None) -> str:
    if n is None:
        return "? bytes"
    return f"{n / 1024 ** 3:.1f} GiB" if n >= 1024 ** 3 else f"{n / 1024 ** 2:.1f} MiB"
