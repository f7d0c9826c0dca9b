"""The node agent's decisions: pure functions over (this node's replica records, what the agent
observed of their processes, now).

`decide(...)` returns the actions that converge this node's processes toward its replica records.
Every action that records something carries the exact fields to write (`Facts`), so
`workers.agent.loop.Agent` only observes, calls `decide`, writes each replica's fields once
(`writes.merge`) and performs the process side effects (start, signal). Nothing here touches Redis, processes, the network
or the clock, so every rule is table-tested with plain data (tests/unit/test_agent_supervisor.py).

Rules, per replica record on this node:
- stop requested: a planned stop drains first (docs/lifecycle.md): while the drain is not over
  (`Observed.drain`, from `llmgw.state.replica_state.drain_progress`: unpublished, every gateway
  moved on, nothing in flight; or `drain_timeout` passed) the engine keeps serving what it has.
  Then the head records `drained_at` and the attempt gets SIGTERM (through its shim), SIGKILL of its
  group after `stop_grace` (`stop_signals`, the one escalation, also used when the agent shuts
  down); a member part of a multi-node replica waits for its head's drain. Once the process is gone,
  mark it stopped (`stopped_at`; each node of a multi-node replica confirms its own part).
- not running, its source remote (hf://, https://) and not local yet: make it local first
  (`weights.fetch_step`: the node's fetcher downloads, the record shows how far; a failed download
  backs off like a crash), then start on the local path. A stop while it downloads cancels it.
- running and not known to this agent (it was started by a previous agent): adopt it, no restart.
  A member part of a multi-node replica is adopted from the attempt found in the state dir
  (`part_view`), since only the head writes the record's agent fields.
- running but not healthy within its start timeout, or unhealthy for `liveness_timeout` after being
  ready: terminate it; its exit is then recorded as a failure like any crash.
- the attempt ended without a stop request: record the exit as a failure, with an exponential backoff
  (`backoff_base` * 2^(n-1), capped at `backoff_cap`) before the next attempt.
- not running and its backoff has passed (or it never ran): start the next attempt (`starting` gives
  the facts recorded before the process is spawned).
- a member part of a multi-node replica follows its head: it starts only while the head's attempt
  runs, and is stopped and started again (not counted as a failure) when the head's attempt changes,
  since its old rendezvous is gone.
And for each live attempt found in the state dir whose replica record no longer exists: stop it
(`leftovers`), unless Redis holds no catalog at all (it lost its data): then the record is registered
again from the copy saved when the attempt started (`restored`); a deleted replica's files go after
`dir_retention`.

Modules: `decide` (the rules above, and `remember`), `probes` (`due_probes`: which replicas to probe
now; `probed`: what one result means), `parts` (multi-node member parts), `rules` (the facts of a
start, a failed launch, a shutdown; `stop_signals`), `leftovers`, `events` (`news`: the events and kicks an applied action makes),
`writes` (one pass's facts merged per record), `weights` (the download phase), `policy`, `observed` and
`actions` (the data).
"""

from workers.agent.supervisor.actions import (
    Action,
    Adopt,
    CancelFetch,
    Drained,
    Facts,
    FetchWeights,
    LaunchFailed,
    Learned,
    MarkStopped,
    Probed,
    RecordExit,
    Rejoin,
    Signal,
    Start,
    WeightsFailed,
    WeightsLocal,
    WeightsProgress,
)
from workers.agent.supervisor.decide import decide, decide_one, remember
from workers.agent.supervisor.leftovers import Leftovers, leftovers, restored
from workers.agent.supervisor.events import News, news
from workers.agent.supervisor.observed import Attempt, ExitFacts, Fetch, Found, Observed, Orphan
from workers.agent.supervisor.parts import PART_FIELDS, head_of_part, part_view
from workers.agent.supervisor.policy import LOG_TAIL_BYTES, MAX_FAILURE_TIMES, Policy, backoff
from workers.agent.supervisor.probes import Probe, due_probes, probed
from workers.agent.supervisor.rules import launch_failed, ready_this_attempt, shutdown_exit, starting, stop_signals
from workers.agent.supervisor.weights import fetch_step, needs_weights
from workers.agent.supervisor.writes import Writes, merge, with_fields

__all__ = [
    "Action", "Adopt", "Drained", "Facts", "LaunchFailed", "Learned", "MarkStopped", "Probed", "RecordExit", "Rejoin",
    "Signal", "Start", "decide", "decide_one", "remember", "Leftovers", "leftovers", "restored", "News", "news",
    "Attempt", "ExitFacts", "Found", "Observed", "Orphan", "PART_FIELDS", "head_of_part", "part_view",
    "LOG_TAIL_BYTES", "MAX_FAILURE_TIMES", "Policy", "backoff", "Probe", "due_probes", "probed", "launch_failed",
    "ready_this_attempt", "shutdown_exit", "starting", "stop_signals", "Writes", "merge", "with_fields",
    "CancelFetch", "FetchWeights", "WeightsFailed", "WeightsLocal", "WeightsProgress", "Fetch", "fetch_step",
    "needs_weights",
]
