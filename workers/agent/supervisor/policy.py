"""The supervisor's knobs (`Policy`, filled from `AgentSettings`) and the restart backoff."""

from __future__ import annotations

from dataclasses import dataclass

MAX_FAILURE_TIMES = 30
LOG_TAIL_BYTES = 4000  # of the engine log kept in the record when an attempt ends


@dataclass(frozen=True)
class Policy:
    """How the supervisor restarts, stops and probes (AgentSettings.policy fills it from the environment)."""

    backoff_base: float = 1.0  # LLMGW_AGENT_BACKOFF_BASE
    backoff_cap: float = 60.0  # LLMGW_AGENT_BACKOFF_CAP
    # A failure after this long healthy starts a new streak (so backoff starts over at backoff_base).
    backoff_reset: float = 120.0  # LLMGW_AGENT_BACKOFF_RESET
    stop_grace: float = 10.0  # LLMGW_AGENT_STOP_GRACE: SIGTERM -> SIGKILL
    liveness_timeout: float = 60.0  # LLMGW_AGENT_LIVENESS_TIMEOUT; 0 disables the liveness restart
    # A Ready replica is reported unhealthy only after this many failed probes in a row.
    probe_failures: int = 3  # LLMGW_AGENT_PROBE_FAILURES
    probe_interval: float = 1.0  # LLMGW_AGENT_PROBE_INTERVAL: `/health` of a Ready attempt this often
    # A starting attempt is probed often: the moment it answers is the moment it can be routed.
    start_probe_interval: float = 0.1  # LLMGW_AGENT_START_PROBE_INTERVAL
    # Rewrite an unchanged probe result this often (seconds), so `last_probe_at` shows the agent is alive.
    probe_refresh: float = 5.0
    # A member part that ends while its head still looks up waits this long before it counts as its own
    # failure: when the head dies, the member usually notices first (its rendezvous breaks), and the
    # head's agent needs a moment to record the head's exit, which turns the member's end into a rejoin.
    member_settle: float = 3.0


def backoff(failures: int, policy: Policy) -> float:
    """Seconds before the next attempt after `failures` failures in a row: 1, 2, 4 ... capped."""
    if failures <= 0:
        return 0.0
    return min(policy.backoff_cap, policy.backoff_base * (2 ** min(failures - 1, 30)))


def next_failure(previous: list[float], at: float, policy: Policy) -> tuple[tuple[float, ...], float]:
    """(failure times, next restart time) after a failure at `at`, given the current streak."""
    failures = (list(previous) + [at])[-MAX_FAILURE_TIMES:]
    return tuple(failures), max(at, 0.0) + backoff(len(failures), policy)
