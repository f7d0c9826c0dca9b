"""The records llmgw keeps in Redis: replicas, load samples and published endpoints (a node's are in
`llmgw.state.node_records`, the gateways' reports and the autoscaler's in `llmgw.state.demand_records`).

They are plain dataclasses with `to_dict`/`from_dict`; unknown keys from a newer writer are ignored
so a mixed-version fleet keeps working. Records hold facts only; the state a user sees is derived
from them by `llmgw.state.replica_state.derive`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from llmgw.slo import Targets
from llmgw.state.keys import REPLICA_STOPPED_ON_PREFIX
from llmgw.surface import LEGACY_OPERATIONS, OPERATIONS

T = TypeVar("T")


def from_known(cls: type[T], data: dict[str, Any]) -> T:
    """`cls` from a stored dict, ignoring keys a newer writer added."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in known})


# Fields of a replica record, by who writes them. Each side writes only its own fields (HSET of
# single fields), which is what lets the control plane and the agent update one record concurrently.
CONTROL_FIELDS = (
    "id", "model", "profile", "spec_hash", "node", "nodes", "gpus", "created_at",
    "pending_reason", "pending_refusals", "stop_requested_at", "stop_reason", "launch_dispatched_at",
    "drain_timeout", "unpublished_version", "engine_secret", "credential_generation", "adapters_wanted",
    "adapters_relaunch",
)
AGENT_FIELDS = (
    "port", "url", "pid", "pid_start", "engine_pid", "started_at", "attempt", "exit_code",
    "exit_signal", "exited_at", "last_probe_at", "last_probe_ok", "probe_error", "first_ready_at",
    "restarts", "failure_times", "next_restart_at", "log_tail", "stopped_at", "adopted_at",
    "master_port", "kv_events_port", "kv_replay_port", "drained_at", "drain_note", "log_path", "cpus",
    "weights_source", "weights_phase", "weights_done", "weights_total", "weights_rate", "weights_eta",
    "weights_file", "weights_started_at", "weights_local_at", "weights_path", "weights_error_kind",
    "weights_error", "weights_failed_at", "engine_memory",
    "adapters_held", "adapters_loading", "adapter_failures", "adapters_attempt",
)
# Plus one field per node, `stopped_on:<node>` (llmgw.state.keys.replica_stopped_on), written by each node's
# agent of a multi-node replica; read back as `ReplicaRecord.stopped_nodes`.


@dataclass
class ReplicaRecord:
    # --- written by the control plane -----------------------------------------------------------
    id: str
    model: str
    profile: str
    spec_hash: str = ""  # hash of the effective profile spec; a change triggers a rolling update
    node: str | None = None  # the head node (serves HTTP); None while Pending
    nodes: list[str] = field(default_factory=list)  # all nodes of a multi-node replica, head first
    gpus: dict[str, list[int]] = field(default_factory=dict)  # node -> GPU indexes allocated
    created_at: float = 0.0
    pending_reason: str | None = None  # why it could not be placed, for humans
    # ... and why each live node refused it: [{"why", "nodes" (the first few), "count"}], most nodes
    # first (`workers.control.placement.refusals`; `llmgw explain` shows them).
    pending_refusals: list[dict] = field(default_factory=list)
    stop_requested_at: float | None = None
    stop_reason: str | None = None
    launch_dispatched_at: float | None = None
    # A planned stop drains first (docs/lifecycle.md): in-flight requests get this long (seconds) to
    # finish after every gateway dropped the replica; 0 = stop at once. Copied from the profile when
    # the stop is requested, so the agent needs no catalog to honour it.
    drain_timeout: float = 0.0
    # The first endpoint-list version that no longer routes to this replica (written by the
    # publisher once a stop was requested): gateways that loaded it send nothing new here.
    unpublished_version: int | None = None
    # The engine's credential (docs/engines.md): generated with the record, passed to the head's engine
    # at launch, sent upstream by the gateways; clients never see it. None: a record made before
    # engines had credentials (its engine serves unauthenticated until it is replaced).
    engine_secret: str | None = field(default=None, repr=False)
    # The model's credential generation when the record was made (`llmgw engines rotate-credentials`
    # bumps it; an older record is outdated and rolled).
    credential_generation: int = 0
    # The W3C traceparent of the control pass that created or placed the record (docs/tracing.md):
    # the agent's launch of it is that pass's child, so a catalog apply can be followed to the engine.
    # None: that pass was not traced.
    traceparent: str | None = None
    # --- written by the node agent (facts about the process) ------------------------------------
    port: int | None = None
    url: str | None = None  # http://address:port of the head's engine
    pid: int | None = None  # the supervising shim: session and process-group leader
    pid_start: int | None = None  # /proc/<pid>/stat field 22, to tell a reused pid apart
    engine_pid: int | None = None
    started_at: float | None = None  # start of the current attempt
    attempt: int = 0  # how many times the agent has started it
    exit_code: int | None = None  # of the last attempt; negative = killed by that signal
    exit_signal: int | None = None
    exited_at: float | None = None
    last_probe_at: float | None = None
    last_probe_ok: bool | None = None
    probe_error: str | None = None
    first_ready_at: float | None = None  # of the current attempt
    restarts: int = 0
    failure_times: list[float] = field(default_factory=list)  # recent unexpected exits
    next_restart_at: float | None = None
    log_tail: str | None = None
    stopped_at: float | None = None  # process confirmed gone after a stop request
    adopted_at: float | None = None  # when a restarted agent took over a running engine
    # Multi-node: the torch.distributed rendezvous port the head chose for its current attempt (members
    # join `node address:master_port`, and restart their part when the head's `attempt` changes).
    master_port: int | None = None
    # `kv_events: true`: the head's KV events (ZMQ PUB) and replay (ROUTER) ports on its node.
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    # A CPU replica of vLLM (`device: cpu`): the cores on its node its threads are bound to (chosen by
    # its agent, workers/agent/cores.py); empty for every other replica.
    cpus: list[int] = field(default_factory=list)
    # The engine's log file on its node (`llmgw logs` reads it there; status and explain name it).
    log_path: str | None = None
    # The agent judged the drain of a planned stop over (and sent SIGTERM) at this time, and why.
    drained_at: float | None = None
    drain_note: str | None = None
    # The download of a remote source's weights before the engine starts (docs/weights.md): what is
    # fetched, how far it is (phase: queued, resolving, waiting, downloading, verifying, failed), when
    # the weights became local and the path the engine loads; a failed download's kind and reason.
    weights_source: str | None = None  # None: the source is local (a path, pkg:), nothing to download
    weights_phase: str | None = None
    weights_done: int = 0  # bytes on disk
    weights_total: int | None = None
    weights_rate: float | None = None  # bytes per second
    weights_eta: float | None = None  # seconds
    weights_file: str | None = None  # the file being fetched
    weights_started_at: float | None = None  # of the current download attempt
    weights_local_at: float | None = None  # complete on the node: the engine may start
    weights_path: str | None = None
    weights_error_kind: str | None = None  # auth | not_found | disk_full | checksum | connection | ...
    weights_error: str | None = None
    weights_failed_at: float | None = None
    # What the engine's log said it took once Ready (`EngineDriver.memory_report`), beside the fit estimate.
    engine_memory: str | None = None
    # --- loaded, never stored under this name ------------------------------------------------------
    # Nodes whose agent confirmed its part stopped (the `stopped_on:<node>` fields), sorted.
    stopped_nodes: list[str] = field(default_factory=list)
    # --- LoRA adapters (docs/catalog.md#adapters-lora) ------------------------------------------------
    # Control plane: the adapters this replica should hold (`workers.control.adapterplacement.place_adapters`).
    # On an engine that loads adapters at launch (llama.cpp) it is the launch set, in id order, written
    # with the record and never changed in place (a different set is a replacement replica).
    adapters_wanted: list[str] = field(default_factory=list)
    # Control plane, llama.cpp: the adapters this replica's replacement is launched with; set, the
    # replica is outdated and rolled like any spec change.
    adapters_relaunch: list[str] | None = None
    # Agent: what the engine of attempt `adapters_attempt` holds (in id order), what it is loading now,
    # and the last failed load of each adapter: {name: {"reason", "at", "attempts"}}. Held adapters of
    # another attempt are held no more (an engine forgets runtime adapters when it restarts).
    adapters_held: list[str] = field(default_factory=list)
    adapters_loading: list[str] = field(default_factory=list)
    adapter_failures: dict[str, dict] = field(default_factory=dict)
    adapters_attempt: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["stopped_nodes"]  # stored as one field per node, written by each agent
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ReplicaRecord":
        stopped = sorted(k[len(REPLICA_STOPPED_ON_PREFIX):] for k, v in d.items()
                         if k.startswith(REPLICA_STOPPED_ON_PREFIX) and v is not None)
        rec = from_known(cls, {k: v for k, v in d.items() if k != "stopped_nodes"})
        rec.stopped_nodes = stopped
        return rec

    @property
    def all_nodes(self) -> list[str]:
        """Every node this replica runs on, head first (one for all but multi-node replicas)."""
        return list(self.nodes) or ([self.node] if self.node else [])

    @property
    def holds(self) -> list[str]:
        """The adapters the current attempt's engine holds (none when they were held by another)."""
        return list(self.adapters_held) if self.adapters_attempt == self.attempt and self.attempt else []

    @property
    def running(self) -> bool:
        """The agent has a live process for the current attempt."""
        return self.started_at is not None and (
            self.exited_at is None or self.exited_at < self.started_at
        )


# KV capacity assumed for an endpoint that says nothing of its own (tokens): a modest GPU replica
# (vLLM's KV on a 24 GB card for a 7-8B model is ~40-100k tokens; llama.cpp's default is 4 slots of
# 4096). Too large predicts hits the engine already evicted; too small forgets ones it kept.
DEFAULT_KV_TOKENS = 32768


@dataclass(frozen=True)
class LoadRecord:
    """One scrape of one replica's /metrics, mapped to llmgw's three numbers.

    None means unknown (series absent or not mapped), never zero: the router must not mistake an
    engine that does not report KV usage for an idle one.
    """

    replica_id: str
    ts: float
    ok: bool
    error: str | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    # The engine's prefix cache since it started (vLLM's vllm:prefix_cache_queries / _hits, in tokens).
    prefix_queries_total: float | None = None
    prefix_hits_total: float | None = None
    # Seconds the engine spent prefilling prompts since it started (vLLM's request_prefill_time sum,
    # llama.cpp's prompt_seconds_total): over the prompt tokens it computed, its prefill rate.
    prefill_seconds_total: float | None = None
    # The prompt tokens those seconds computed (not found in the prefix cache), counted with the same
    # requests as the seconds (vLLM's request_prefill_kv_computed_tokens sum: both observed as each
    # request ends); None where the engine counts its seconds with its prompt tokens (llama.cpp).
    prefill_tokens_total: float | None = None
    # The engine's KV cache in tokens (vLLM's vllm:cache_config_info: num_gpu_blocks x block_size);
    # None when it does not say. The gateway sizes its index of what it sent there to it.
    kv_tokens: int | None = None
    # The longest sequence (prompt + output) the engine takes, as its GET /v1/models says; None when
    # it does not say (or was not asked yet).
    context_length: int | None = None
    # LoRA activity (vLLM's `vllm:lora_requests_info`, the sim's too): the adapters with requests
    # running and waiting, and `max_loras`; None when the engine does not say.
    lora_running: list[str] | None = None
    lora_waiting: list[str] | None = None
    lora_max: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoadRecord":
        return from_known(cls, d)


@dataclass(frozen=True)
class EndpointInfo:
    """One routable replica, as published to the gateway (the seed's endpoint.Info)."""

    id: str
    url: str
    models: tuple[str, ...]  # canonical name first, then aliases
    engine: str
    pool: str = "default"
    weight: float = 1.0
    priority: int = 0
    capacity: int | None = None  # concurrent requests one replica serves well
    served_name: str = ""  # the name the engine answers to; the gateway rewrites `model` to it
    model: str = ""  # canonical model name
    profile: str = ""
    node: str = ""
    # What the gateway sends upstream as `Authorization: Bearer` (the replica's engine_secret; empty
    # for an engine started without one). The list lives in Redis, which only llmgw's parts read.
    engine_secret: str = field(default="", repr=False)
    # Operation (llmgw.surface) -> the engine's path for it. None: published by an llmgw that
    # had no map, whose endpoints served chat, completions and embeddings at the OpenAI paths.
    paths: dict[str, str] | None = field(default=None, hash=False)
    # The NAME of the gateway's environment variable holding this endpoint's API key (external
    # servers); the gateway sends its value to this endpoint only. Never the key itself.
    api_key_env: str | None = None
    # LoRA: the adapters the replica holds and may be sent requests for (in id order: llama.cpp's
    # per-request `lora` list indexes them), and how many it holds at most (its `max_loras`; 0: none).
    adapters: tuple[str, ...] = ()
    adapter_slots: int = 0
    # What the gateway minimises for this model's requests (the catalog's `routing.objective`):
    # "first_token" | "completion"; empty: from the request (streamed -> first_token).
    objective: str = ""
    # Whether an answer of this model whose engine breaks off moves to another replica (the catalog's
    # `routing.resume`; gateway.http.resume).
    resume: bool = True
    # The model's default latency targets (the catalog's `slo:`, llmgw.catalog.slo), in seconds (None:
    # none); a request's own headers and its key's defaults come first (llmgw.slo.resolve).
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    slo_deadline: float | None = None
    slo_strict: bool = False
    # Precise prefix routing (`kv_events: true`): where the engine publishes its KV cache events and
    # answers replays (tcp://node:port); empty: the gateway predicts from what it sent.
    kv_events: str = ""
    kv_replay: str = ""
    # The tokenizer the gateway needs to match prompts against those events (`hf://org/repo[@rev]`);
    # empty: the engine's own (the simulated engine), or none known.
    tokenizer: str = ""
    # The catalog's `kv_cache_tokens`: the KV cache one replica holds, in tokens, which sizes the
    # gateway's index of what it sent there (before the engine's own figure); None: not declared.
    kv_tokens: int | None = None
    # Its replica runs a spec the catalog no longer has: a rolling update replaces it and drains it once
    # its replacement is Ready. A continuation (an answer resumed after a break) goes elsewhere while it
    # can (gateway.routing.choice.eligible): it would break again under that drain.
    retiring: bool = False

    def slo_targets(self) -> Targets | None:
        """The model's default latency targets, or None when its catalog sets none."""
        if self.slo_ttft is None and self.slo_tpot is None and self.slo_deadline is None:
            return None
        return Targets(self.slo_ttft, self.slo_tpot, self.slo_deadline, self.slo_strict)

    def serves(self, op: str) -> bool:
        return op in self.paths if self.paths is not None else op in LEGACY_OPERATIONS

    def path(self, op: str) -> str:
        """The engine's path for `op` (which it serves)."""
        return self.paths[op] if self.paths is not None else OPERATIONS[op][1]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["models"] = list(self.models)
        d["adapters"] = list(self.adapters)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EndpointInfo":
        d = dict(d)
        d["models"] = tuple(d.get("models") or ())
        d["adapters"] = tuple(d.get("adapters") or ())
        return from_known(cls, d)


@dataclass(frozen=True)
class ExternalRecord:
    """The health-check facts of one external server url (`engine: external`), written by the
    control plane's `llmgw.external` pass; `llmgw.state.replica_state.derive_external` says whether it
    is Ready or Unreachable. `id` is the endpoint id it is published under."""

    id: str
    model: str
    profile: str
    url: str
    checked_at: float | None = None  # the last check
    ok: bool | None = None  # its result
    error: str | None = None  # why the last failed check failed
    failures: int = 0  # failed checks in a row
    last_ok_at: float | None = None
    changed_at: float | None = None  # when it last turned Ready or Unreachable
    # Failed checks in a row that make it Unreachable (LLMGW_EXTERNAL_FAILURES when written), so every
    # reader derives the same state.
    unreachable_after: int = 3
    context_length: int | None = None  # as its GET /v1/models last said

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ExternalRecord":
        return from_known(cls, d)
