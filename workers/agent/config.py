"""The node agent's own knobs (LLMGW_AGENT_*), read once at start-up. See docs/agent.md."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from llmgw.errors import ConfigError
from workers.agent.supervisor import Policy


@dataclass(frozen=True)
class AgentConfig:
    # The supervision knobs take their defaults from `supervisor.Policy`: one source for both.
    tick: float = 0.5  # LLMGW_AGENT_TICK: longest wait between passes (a wake-up ends it early)
    keep_engines: bool = False  # LLMGW_AGENT_KEEP_ENGINES=1: leave engines running on shutdown
    backoff_base: float = Policy.backoff_base  # LLMGW_AGENT_BACKOFF_BASE
    backoff_cap: float = Policy.backoff_cap  # LLMGW_AGENT_BACKOFF_CAP
    backoff_reset: float = Policy.backoff_reset  # LLMGW_AGENT_BACKOFF_RESET
    stop_grace: float = Policy.stop_grace  # LLMGW_AGENT_STOP_GRACE
    liveness_timeout: float = Policy.liveness_timeout  # LLMGW_AGENT_LIVENESS_TIMEOUT (0 = never restart a once-ready engine)
    probe_interval: float = 1.0  # LLMGW_AGENT_PROBE_INTERVAL
    probe_timeout: float = 1.0  # LLMGW_AGENT_PROBE_TIMEOUT
    probe_failures: int = Policy.probe_failures  # LLMGW_AGENT_PROBE_FAILURES: failed probes in a row before a Ready one is Unhealthy
    scrape_interval: float = 1.0  # LLMGW_AGENT_SCRAPE_INTERVAL
    scrape_timeout: float = 1.0  # LLMGW_AGENT_SCRAPE_TIMEOUT
    log_max_bytes: int = 10 * 1024 * 1024  # LLMGW_AGENT_LOG_MAX_BYTES: rotate engine.log past this
    log_keep: int = 3  # LLMGW_AGENT_LOG_KEEP: rotated files kept
    dir_retention: float = 3600.0  # LLMGW_AGENT_DIR_RETENTION: keep a deleted replica's files this long

    @property
    def policy(self) -> Policy:
        return Policy(
            backoff_base=self.backoff_base,
            backoff_cap=self.backoff_cap,
            backoff_reset=self.backoff_reset,
            stop_grace=self.stop_grace,
            liveness_timeout=self.liveness_timeout,
            probe_failures=self.probe_failures,
            probe_refresh=5 * self.probe_interval,  # an unchanged probe result is rewritten this often
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AgentConfig":
        env = os.environ if env is None else env
        kw: dict = {}
        floats = {
            "tick": ("LLMGW_AGENT_TICK", False),
            "backoff_base": ("LLMGW_AGENT_BACKOFF_BASE", False),
            "backoff_cap": ("LLMGW_AGENT_BACKOFF_CAP", False),
            "backoff_reset": ("LLMGW_AGENT_BACKOFF_RESET", True),
            "stop_grace": ("LLMGW_AGENT_STOP_GRACE", True),
            "liveness_timeout": ("LLMGW_AGENT_LIVENESS_TIMEOUT", True),
            "probe_interval": ("LLMGW_AGENT_PROBE_INTERVAL", False),
            "probe_timeout": ("LLMGW_AGENT_PROBE_TIMEOUT", False),
            "scrape_interval": ("LLMGW_AGENT_SCRAPE_INTERVAL", False),
            "scrape_timeout": ("LLMGW_AGENT_SCRAPE_TIMEOUT", False),
            "dir_retention": ("LLMGW_AGENT_DIR_RETENTION", True),
        }
        for name, (var, zero_ok) in floats.items():
            if env.get(var):
                try:
                    value = float(env[var])
                except ValueError:
                    raise ConfigError(var, f"expected seconds, got {env[var]!r}") from None
                if value < 0 or (value == 0 and not zero_ok):
                    raise ConfigError(var, "must be positive" if not zero_ok else "must not be negative")
                kw[name] = value
        for name, var in (("log_max_bytes", "LLMGW_AGENT_LOG_MAX_BYTES"), ("log_keep", "LLMGW_AGENT_LOG_KEEP"),
                          ("probe_failures", "LLMGW_AGENT_PROBE_FAILURES")):
            if env.get(var):
                try:
                    kw[name] = int(env[var])
                except ValueError:
                    raise ConfigError(var, f"expected an integer, got {env[var]!r}") from None
                if kw[name] < 0:
                    raise ConfigError(var, "must not be negative")
        keep = env.get("LLMGW_AGENT_KEEP_ENGINES", "").strip().lower()
        if keep not in ("", "0", "1", "true", "false", "yes", "no"):
            raise ConfigError("LLMGW_AGENT_KEEP_ENGINES", f"expected 1 or 0, got {keep!r}")
        kw["keep_engines"] = keep in ("1", "true", "yes")
        if kw.get("probe_failures") == 0:
            raise ConfigError("LLMGW_AGENT_PROBE_FAILURES", "must be at least 1")
        cfg = cls(**kw)
        if cfg.backoff_cap < cfg.backoff_base:
            raise ConfigError("LLMGW_AGENT_BACKOFF_CAP", "must be at least LLMGW_AGENT_BACKOFF_BASE")
        return cfg
