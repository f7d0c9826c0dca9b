"""The node agent's settings: this node's identity and resources, engine ports, heartbeats and the
`LLMGW_AGENT_*` supervision knobs, read once at start-up. See docs/agent.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import BeforeValidator, model_validator
from pydantic_settings import NoDecode

from llmgw.errors import ConfigError
from llmgw.settings import PortRange, Seconds, Settings, env
from workers.agent.supervisor import Policy


def _labels(value: object) -> object:
    """`k=v,k2=v2` -> {"k": "v", "k2": "v2"}."""
    if not isinstance(value, str):
        return value
    labels: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected key=value, got {item!r}")
        labels[key.strip()] = val.strip()
    return labels


_UNITS = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "t": 1000 ** 4, "ki": 1024, "mi": 1024 ** 2,
          "gi": 1024 ** 3, "ti": 1024 ** 4}


def _byte_size(value: object) -> object:
    """`500GiB`, `1.5T`, `800G`, `123456789` (bytes) -> bytes; `k/M/G/T` are powers of 1000, `Ki/Mi/Gi/Ti`
    of 1024, a trailing `B` optional."""
    if not isinstance(value, str):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", value)
    if not m:
        raise ValueError(f"expected a size such as 500GiB or 800G, got {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


class AgentSettings(Settings):
    """Everything a node agent reads (besides the shared `Settings`)."""

    docs: ClassVar[str] = "docs/agent.md"

    # --- this node -------------------------------------------------------------------------------
    node_pool: str = env("LLMGW_NODE_POOL", default="default", meaning="the node's pool (profiles' `pool` selects it)")
    node_labels: Annotated[dict[str, str], NoDecode, BeforeValidator(_labels)] = env(
        "LLMGW_NODE_LABELS", default_factory=dict, meaning="`k=v,k2=v2`, matched by profiles' `node_selector`")
    node_gpus: str | None = env(
        "LLMGW_NODE_GPUS", default=None, empty_is_value=True,
        meaning="overrides GPU discovery (`nvidia-smi`), e.g. `h100:8` or `a10g:1,l4:2`; empty = none")
    node_address: str = env("LLMGW_NODE_ADDRESS", default="127.0.0.1",
                            meaning="the address other machines (the gateway) use to reach this node's engines")
    engine_host: str = env("LLMGW_ENGINE_HOST", default="127.0.0.1",
                           meaning="the address engines bind to (`0.0.0.0` when the gateway is elsewhere)")
    port_range: PortRange = env(
        "LLMGW_PORT_RANGE", default=(21000, 21999),
        meaning="ports handed to engines on this node, `START-END`; keep it outside the kernel's ephemeral "
                "range (`net.ipv4.ip_local_port_range`): the agent warns at start-up when it overlaps")
    heartbeat_interval: Seconds = env("LLMGW_HEARTBEAT_INTERVAL", default=2.0, gt=0,
                                      meaning="how often the node writes its heartbeat")
    heartbeat_ttl: Seconds = env("LLMGW_HEARTBEAT_TTL", default=6.0, gt=0,
                                 meaning="the heartbeat's lifetime: this long after the last one the node is Lost")
    # --- supervision (defaults from `supervisor.Policy`: one source for both) ----------------------
    tick: Seconds = env("LLMGW_AGENT_TICK", default=0.5, gt=0,
                        meaning="longest wait between passes (a wake-up ends it)")
    keep_engines: bool = env("LLMGW_AGENT_KEEP_ENGINES", default=True,
                             meaning="engines keep serving when the agent stops (an upgrade, a restart): the next "
                                     "agent adopts them; 0: stop this node's engines with the agent")
    backoff_base: Seconds = env("LLMGW_AGENT_BACKOFF_BASE", default=Policy.backoff_base, gt=0,
                                meaning="first restart delay")
    backoff_cap: Seconds = env("LLMGW_AGENT_BACKOFF_CAP", default=Policy.backoff_cap, gt=0,
                               meaning="longest restart delay")
    backoff_reset: Seconds = env("LLMGW_AGENT_BACKOFF_RESET", default=Policy.backoff_reset, ge=0,
                                 meaning="healthy this long = the next failure starts a new streak")
    stop_grace: Seconds = env("LLMGW_AGENT_STOP_GRACE", default=Policy.stop_grace, ge=0,
                              meaning="SIGTERM -> SIGKILL")
    liveness_timeout: Seconds = env("LLMGW_AGENT_LIVENESS_TIMEOUT", default=Policy.liveness_timeout, ge=0,
                                    meaning="restart a once-ready engine failing probes this long (0: never)")
    probe_interval: Seconds = env("LLMGW_AGENT_PROBE_INTERVAL", default=Policy.probe_interval, gt=0,
                                  meaning="`/health` probe period per replica")
    start_probe_interval: Seconds = env(
        "LLMGW_AGENT_START_PROBE_INTERVAL", default=Policy.start_probe_interval, gt=0,
        meaning="`/health` probe period while an attempt is starting, so a Ready engine is routed at once")
    probe_timeout: Seconds = env("LLMGW_AGENT_PROBE_TIMEOUT", default=1.0, gt=0, meaning="`/health` timeout")
    probe_failures: int = env("LLMGW_AGENT_PROBE_FAILURES", default=Policy.probe_failures, ge=1,
                              meaning="failed probes in a row before a Ready replica is reported unhealthy")
    scrape_interval: Seconds = env("LLMGW_AGENT_SCRAPE_INTERVAL", default=1.0, gt=0, meaning="`/metrics` period")
    scrape_timeout: Seconds = env("LLMGW_AGENT_SCRAPE_TIMEOUT", default=1.0, gt=0, meaning="`/metrics` timeout")
    log_max_bytes: int = env("LLMGW_AGENT_LOG_MAX_BYTES", default=10 * 1024 * 1024, ge=0,
                             meaning="rotate `engine.log` past this many bytes")
    log_keep: int = env("LLMGW_AGENT_LOG_KEEP", default=3, ge=0, meaning="rotated log files kept")
    dir_retention: Seconds = env("LLMGW_AGENT_DIR_RETENTION", default=3600.0, ge=0,
                                 meaning="keep a deleted replica's files this long")
    # --- LoRA adapters (workers/agent/adapterkeeper.py) ---------------------------------------------------
    adapter_unload_grace: Seconds = env("LLMGW_AGENT_ADAPTER_UNLOAD_GRACE", default=5.0, ge=0,
                                        meaning="an adapter no longer wanted is unloaded this long after (the "
                                                "gateways stopped sending it requests meanwhile)")
    adapter_timeout: Seconds = env("LLMGW_AGENT_ADAPTER_TIMEOUT", default=120.0, gt=0,
                                   meaning="how long one adapter load or unload call may take")

    # --- weights (docs/weights.md) ------------------------------------------------------------------
    weights_dir_setting: Path | None = env(
        "LLMGW_WEIGHTS_DIR", default=None,
        meaning="where this node keeps downloaded weights (`hub/`: huggingface_hub's cache layout); "
                "default `<LLMGW_STATE_DIR>/weights`")
    weights_budget: Annotated[int | None, NoDecode, BeforeValidator(_byte_size)] = env(
        "LLMGW_WEIGHTS_BUDGET", default=None, gt=0,
        meaning="most bytes of weights kept on this node (`500GiB`); unused weights are evicted by least "
                "recent use to stay under it; none: only the free disk limits")
    downloads: int = env("LLMGW_DOWNLOADS", default=2, ge=1,
                         meaning="sources this node downloads at once (two replicas of one source share one)")

    @property
    def weights_dir(self) -> Path:
        return (self.weights_dir_setting or Path(self.state_dir) / "weights").absolute()

    @model_validator(mode="after")
    def _cap_above_base(self) -> AgentSettings:
        if self.backoff_cap < self.backoff_base:
            raise ConfigError("LLMGW_AGENT_BACKOFF_CAP", "must be at least LLMGW_AGENT_BACKOFF_BASE")
        return self

    @property
    def policy(self) -> Policy:
        return Policy(
            backoff_base=self.backoff_base,
            backoff_cap=self.backoff_cap,
            backoff_reset=self.backoff_reset,
            stop_grace=self.stop_grace,
            liveness_timeout=self.liveness_timeout,
            probe_failures=self.probe_failures,
            probe_interval=self.probe_interval,
            start_probe_interval=self.start_probe_interval,
            probe_refresh=5 * self.probe_interval,  # an unchanged probe result is rewritten this often
        )
