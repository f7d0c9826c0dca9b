"""What the supervisor decides: each action carries the exact facts to record (`Facts`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from workers.agent.supervisor.observed import ExitFacts


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What an action records. `fields`: facts of this node's part of the replica (the record's agent
    fields for the head or a single-node replica; the agent's memory for a member part, whose record
    fields are the head's). `confirm`: fields written to the record whoever runs the part (a node's
    `stopped_on:<node>`). `tail`: record the end of the engine log as `log_tail`, followed by this note
    (None: leave `log_tail` alone). `message`/`level`: the line to log."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    confirm: Mapping[str, Any] = field(default_factory=dict)
    tail: str | None = None
    message: str = field(default="", compare=False)
    level: int = field(default=logging.INFO, compare=False)


@dataclass(frozen=True)
class Start:
    """Start the next attempt: the loop chooses its port and builds its command, records `starting`
    (or `launch_failed`), then spawns it."""

    replica_id: str
    attempt: int
    restart: bool  # an earlier attempt existed
    head_attempt: int | None = None  # a member part: the head attempt it joins
    weights_path: str | None = None  # the downloaded weights the engine loads (None: the catalog's source)


@dataclass(frozen=True)
class Adopt(Facts):
    replica_id: str
    pid: int | None
    pid_start: int | None
    engine_pid: int | None


@dataclass(frozen=True)
class Learned(Facts):
    """Facts of a known running attempt the record lacks (the engine's pid, once the shim started it)."""

    replica_id: str


@dataclass(frozen=True)
class Signal:
    replica_id: str
    pid: int
    pid_start: int | None
    sig: int  # SIGTERM goes to the shim (which forwards it once); SIGKILL to the whole group
    reason: str
    orphan: bool = False


@dataclass(frozen=True)
class Drained(Facts):
    """The drain of a planned stop is over (or timed out): recorded by the head before its SIGTERM."""

    replica_id: str


@dataclass(frozen=True)
class RecordExit(Facts):
    """The attempt ended without a stop request: a failure, restarted after `next_restart_at`."""

    replica_id: str
    exit: ExitFacts
    failure_times: tuple[float, ...]
    next_restart_at: float
    restarts: int
    reason: str = ""


@dataclass(frozen=True)
class MarkStopped(Facts):
    replica_id: str
    exit: ExitFacts | None
    stopped_at: float


@dataclass(frozen=True)
class Rejoin(Facts):
    """A member part ended because its head's attempt changed: start again for the new one, no failure."""

    replica_id: str
    exit: ExitFacts


@dataclass(frozen=True)
class LaunchFailed(Facts):
    """An attempt that could not even be launched (engine driver error, no free port, shim failed to start):
    a failure like a crash, with the same streak and backoff."""

    replica_id: str
    attempt: int
    at: float
    failure_times: tuple[float, ...]
    next_restart_at: float
    restarts: int
    reason: str


@dataclass(frozen=True)
class Probed(Facts):
    """The outcome of one `/health` probe. `fields` are the facts to write (empty: nothing to report
    this time); `probe_failures` is the new count of failures in a row; `became_ready` the first success
    of this attempt."""

    replica_id: str
    ok: bool
    probe_failures: int
    became_ready: bool = False


@dataclass(frozen=True)
class FetchWeights(Facts):
    """Make the part's remote source local (the agent's fetcher: one download per source on the node,
    resumed from what is on disk); `fields` mark the download begun."""

    replica_id: str
    source: str
    layout: str  # llamacpp | vllm: which files of the source, laid out how


@dataclass(frozen=True)
class WeightsProgress(Facts):
    """How far the download is (`fields`: phase, bytes, rate, ETA); `milestone`: the 25/50/75 % it passed."""

    replica_id: str
    milestone: int | None = None


@dataclass(frozen=True)
class WeightsLocal(Facts):
    """The weights are complete on the node: the engine may start on `path`."""

    replica_id: str
    path: str
    size: int
    fetched: int = 0  # bytes this download fetched (0: they were here already)
    seconds: float = 0.0


@dataclass(frozen=True)
class WeightsFailed(Facts):
    """The download failed (`kind`: auth, not_found, disk_full, checksum, connection, ...): a failure like
    an engine's exit, with the same streak and backoff before the next try."""

    replica_id: str
    kind: str
    reason: str
    next_restart_at: float


@dataclass(frozen=True)
class CancelFetch:
    """The part stopped (or its download ended): drop its interest in the download, which stops once no
    other replica of the node wants the source."""

    replica_id: str


Action = (Start | Adopt | Learned | Drained | Signal | RecordExit | MarkStopped | Rejoin | LaunchFailed | Probed
          | FetchWeights | WeightsProgress | WeightsLocal | WeightsFailed | CancelFetch)
