"""Settings read once from the environment.

Every process (gateway, control worker, node agent, beat, CLI) builds one `Settings` at start-up and
passes it down; nothing else reads `os.environ` for llmgw knobs. Each field names its variable.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping

from llmgw.errors import ConfigError


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("LLMGW_NODE_LABELS", f"expected key=value, got {item!r}")
        labels[key.strip()] = value.strip()
    return labels


def _parse_range(name: str, text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        start, end = int(lo), int(hi)
    except ValueError:
        raise ConfigError(name, f"expected START-END, got {text!r}") from None
    if not sep or not (0 < start <= end < 65536):
        raise ConfigError(name, f"expected START-END within 1..65535, got {text!r}")
    return start, end


@dataclass(frozen=True)
class Settings:
    # LLMGW_REDIS_URL or REDIS_URL: the one Redis every part shares.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # LLMGW_NODE: this machine's node name; its agent consumes the queue node-<name>.
    node_name: str = field(default_factory=socket.gethostname)
    # LLMGW_STATE_DIR: logs, engine exit files, redis data for `llmgw up`.
    state_dir: Path = Path(".llmgw")
    # LLMGW_NODE_POOL / LLMGW_NODE_LABELS (k=v,k2=v2): what placement filters on.
    node_pool: str = "default"
    node_labels: Mapping[str, str] = field(default_factory=dict)
    # LLMGW_NODE_GPUS: overrides GPU discovery, e.g. "h100:8" or "a10g:1,l4:2"; "" means none.
    node_gpus: str | None = None
    # LLMGW_NODE_ADDRESS: the address other machines use to reach this node's engines.
    node_address: str = "127.0.0.1"
    # LLMGW_ENGINE_HOST: the address engines bind to.
    engine_host: str = "127.0.0.1"
    # LLMGW_PORT_RANGE: ports handed to engines on this node.
    port_range: tuple[int, int] = (21000, 21999)
    # LLMGW_HEARTBEAT_INTERVAL / LLMGW_HEARTBEAT_TTL (seconds): node liveness.
    heartbeat_interval: float = 2.0
    heartbeat_ttl: float = 6.0
    # LLMGW_RECONCILE_INTERVAL / LLMGW_PUBLISH_INTERVAL (seconds): the beat schedule.
    reconcile_interval: float = 2.0
    publish_interval: float = 1.0
    # LLMGW_CATALOG: a catalog file the control plane re-reads when it changes.
    catalog_file: Path | None = None
    # LLMGW_EVENT_DRIVEN (1): facts (a catalog apply, a replica turning Ready, a stop...) kick the
    # control passes at once; 0 leaves only beat's timers (tests of the backstop).
    event_driven: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        kw: dict = {}
        url = env.get("LLMGW_REDIS_URL") or env.get("REDIS_URL")
        if url:
            kw["redis_url"] = url
        if env.get("LLMGW_NODE"):
            kw["node_name"] = env["LLMGW_NODE"]
        # Absolute from the start: engines run with their replica dir as working directory, so a
        # relative path would point somewhere else for them (and for the shim).
        kw["state_dir"] = Path(env.get("LLMGW_STATE_DIR") or ".llmgw").absolute()
        if env.get("LLMGW_NODE_POOL"):
            kw["node_pool"] = env["LLMGW_NODE_POOL"]
        if "LLMGW_NODE_LABELS" in env:
            kw["node_labels"] = _parse_labels(env["LLMGW_NODE_LABELS"])
        if "LLMGW_NODE_GPUS" in env:
            kw["node_gpus"] = env["LLMGW_NODE_GPUS"]
        if env.get("LLMGW_NODE_ADDRESS"):
            kw["node_address"] = env["LLMGW_NODE_ADDRESS"]
        if env.get("LLMGW_ENGINE_HOST"):
            kw["engine_host"] = env["LLMGW_ENGINE_HOST"]
        if env.get("LLMGW_PORT_RANGE"):
            kw["port_range"] = _parse_range("LLMGW_PORT_RANGE", env["LLMGW_PORT_RANGE"])
        for name, var in (
            ("heartbeat_interval", "LLMGW_HEARTBEAT_INTERVAL"),
            ("heartbeat_ttl", "LLMGW_HEARTBEAT_TTL"),
            ("reconcile_interval", "LLMGW_RECONCILE_INTERVAL"),
            ("publish_interval", "LLMGW_PUBLISH_INTERVAL"),
        ):
            if env.get(var):
                try:
                    value = float(env[var])
                except ValueError:
                    raise ConfigError(var, f"expected seconds, got {env[var]!r}") from None
                if value <= 0:
                    raise ConfigError(var, "must be positive")
                kw[name] = value
        if env.get("LLMGW_CATALOG"):
            kw["catalog_file"] = Path(env["LLMGW_CATALOG"])
        flag = env.get("LLMGW_EVENT_DRIVEN", "").strip().lower()
        if flag not in ("", "0", "1", "true", "false", "yes", "no"):
            raise ConfigError("LLMGW_EVENT_DRIVEN", f"expected 1 or 0, got {flag!r}")
        if flag:
            kw["event_driven"] = flag in ("1", "true", "yes")
        return cls(**kw)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
