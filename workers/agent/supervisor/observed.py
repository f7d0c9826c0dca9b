"""What the agent observed of a replica's attempt, and what it remembers of it: the decisions' inputs."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.state.replica_state import DrainProgress


@dataclass(frozen=True)
class ExitFacts:
    exit_code: int | None  # negative: killed by that signal; None: unknown
    exit_signal: int | None
    exited_at: float


@dataclass(frozen=True)
class Found:
    """An attempt found in the state dir (`shim.json`): for adopting a member part, for orphans, and
    for a pid that never reached Redis."""

    replica_id: str
    attempt: int
    pid: int
    pid_start: int | None
    engine_pid: int | None
    alive: bool


@dataclass(frozen=True)
class Attempt:
    """What this agent process remembers of one replica's current attempt (lost when it restarts;
    everything that must survive a restart is in Redis or the state dir)."""

    attempt: int = 0
    known: bool = False  # started or adopted by this agent process
    term_sent_at: float | None = None  # when this agent sent SIGTERM to this attempt
    term_reason: str = ""
    last_ok_at: float | None = None  # last successful health probe
    last_probe_at: float | None = None
    probe_failures: int = 0  # failed probes in a row


@dataclass(frozen=True)
class Fetch:
    """The node's download of the source a part needs, as the agent's fetcher last saw it."""

    phase: str  # queued | resolving | waiting | downloading | verifying | complete | failed
    done: int = 0
    total: int | None = None
    rate: float | None = None  # bytes per second
    eta: float | None = None
    file: str = ""
    path: str | None = None  # complete: what the engine loads
    fetched: int = 0  # complete: bytes this download fetched
    seconds: float = 0.0  # complete: how long it took
    kind: str | None = None  # failed: auth | not_found | disk_full | checksum | connection | ...
    reason: str | None = None


@dataclass(frozen=True)
class Observed:
    """What the agent knows locally about a replica's current attempt, this pass."""

    alive: bool = False  # the attempt's shim is running (pid, start time and command line checked)
    exit: ExitFacts | None = None  # how it ended, when not alive and it had been started
    known: bool = False  # started or adopted by this agent process
    pid: int | None = None
    pid_start: int | None = None
    engine_pid: int | None = None
    term_sent_at: float | None = None  # when this agent sent SIGTERM to this attempt
    term_reason: str = ""
    last_ok_at: float | None = None  # last successful health probe of this attempt
    start_timeout: float = 120.0
    has_health: bool = True  # False for a headless part (multi-node worker): no probes, no timeouts
    # Multi-node member parts only (None on the head and on single-node replicas): the head's current
    # attempt while it runs (0 while it does not), and the head attempt this part was started for.
    head_attempt: int | None = None
    joined_attempt: int | None = None
    # A stop was requested and the process runs: how far its drain has come (None: no drain, stop now).
    drain: DrainProgress | None = None
    # This pass's `/health` probe, when one was due: its result and the failures in a row before it.
    probe_ok: bool | None = None
    probe_error: str | None = None
    probe_failures: int = 0
    # The remote source (hf://, https://) this part loads, normalised, and how its files are laid out
    # (None: a local source, nothing to download); the node's download of it, if one is under way.
    weights_source: str | None = None
    weights_layout: str | None = None
    fetch: Fetch | None = None

    @property
    def member(self) -> bool:
        return self.head_attempt is not None

    @property
    def stale(self) -> bool:
        """A member part started for a head attempt that is no longer the running one."""
        return self.member and (not self.head_attempt or self.joined_attempt != self.head_attempt)


@dataclass(frozen=True)
class Orphan:
    """A live attempt found in the state dir whose replica record no longer exists."""

    replica_id: str
    pid: int
    pid_start: int | None
    term_sent_at: float | None = None
