"""A whole llmgw on real processes for integration and end-to-end tests.

    cluster = Cluster(tmp_path)           # nothing runs yet
    cluster.start_redis()
    cluster.start_control(); cluster.start_beat()
    cluster.start_node("a"); cluster.start_node("b", gpus="h100:2")
    url = cluster.start_gateway()
    cluster.apply_catalog(yaml_text)
    ...
    cluster.stop()                        # every process, engines included

Each process runs in its own session with its output in tmp_path/logs/<name>.log; `cluster.logs()`
returns their tails for assertion messages.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import redis

from llmgw.state.keys import CONTROL_QUEUE, node_queue
from llmgw.state.store import Store, connect
from tests.support.procs import (
    ProcessSet,
    bin_path,
    free_port,
    free_port_range,
    python,
    redis_server_binary,
    wait_until,
)

# Fast timings so tests converge in seconds; every value is an ordinary, documented knob.
FAST_ENV = {
    "LLMGW_HEARTBEAT_INTERVAL": "0.5",
    "LLMGW_HEARTBEAT_TTL": "3",
    "LLMGW_RECONCILE_INTERVAL": "1",
    "LLMGW_PUBLISH_INTERVAL": "0.5",
    "PYTHONUNBUFFERED": "1",
}


class Cluster:
    def __init__(self, tmp_path: Path, extra_env: dict[str, str] | None = None):
        self.root = Path(tmp_path)
        self.procs = ProcessSet(self.root / "logs")
        self.extra_env = dict(extra_env or {})
        self.redis_port: int | None = None
        self.gateway_url: str | None = None

    # --- environment -------------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        assert self.redis_port, "start_redis() first"
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            **FAST_ENV,
            "REDIS_URL": self.redis_url,
            "LLMGW_STATE_DIR": str(self.root / "state"),
            **self.extra_env,
        }
        env.update(extra)
        return env

    def redis(self) -> redis.Redis:
        return connect(self.redis_url)

    def store(self) -> Store:
        return Store(self.redis())

    # --- processes -------------------------------------------------------------------------------
    def start_redis(self) -> str:
        self.redis_port = free_port()
        data = self.root / "redis"
        data.mkdir(parents=True, exist_ok=True)
        self.procs.start(
            "redis",
            [
                redis_server_binary(),
                "--port", str(self.redis_port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(data),
            ],
        )
        wait_until(lambda: self.redis().ping(), 15, what="redis-server to answer PING")
        return self.redis_url

    def stop_redis(self) -> None:
        self.procs.get("redis").stop()

    def restart_redis(self) -> None:
        """Start redis again on the same port (data is not kept: tests use it for outages)."""
        port = self.redis_port
        data = self.root / "redis"
        self.procs.start(
            "redis",
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(data)],
        )
        wait_until(lambda: self.redis().ping(), 15, what="redis-server to answer PING again")

    def celery(self, *args: str) -> list[str]:
        return [bin_path("celery"), "-A", "workers", *args]

    def start_control(self, name: str = "control", **env: str):
        return self.procs.start(
            name,
            self.celery(
                "worker", "-Q", CONTROL_QUEUE, "-n", f"{name}@%h", "-P", "threads", "-c", "4",
                "--without-gossip", "--without-mingle", "-l", "info",
            ),
            env=self.env(**env),
        )

    def start_beat(self, **env: str):
        return self.procs.start(
            "beat",
            self.celery("beat", "-l", "info", "-s", str(self.root / "beat-schedule")),
            env=self.env(**env),
        )

    def start_node(self, name: str, gpus: str = "", pool: str = "", labels: str = "", **env: str):
        """A node agent: a Celery worker consuming node-<name>, with its own state dir and ports."""
        lo, hi = free_port_range(40)
        node_env = {
            "LLMGW_NODE": name,
            "LLMGW_NODE_GPUS": gpus,
            "LLMGW_STATE_DIR": str(self.root / "nodes" / name),
            "LLMGW_PORT_RANGE": f"{lo}-{hi}",
        }
        if pool:
            node_env["LLMGW_NODE_POOL"] = pool
        if labels:
            node_env["LLMGW_NODE_LABELS"] = labels
        node_env.update(env)
        return self.procs.start(
            f"node-{name}",
            self.celery(
                "worker", "-Q", node_queue(name), "-n", f"{name}@%h", "-P", "threads", "-c", "2",
                "--without-gossip", "--without-mingle", "-l", "info",
            ),
            env=self.env(**node_env),
        )

    def start_gateway(self, port: int | None = None, **env: str) -> str:
        port = port or free_port()
        self.procs.start(
            "gateway",
            [
                bin_path("gunicorn"), "-k", "gthread", "-w", "1", "--threads", "128",
                "-b", f"127.0.0.1:{port}", "--graceful-timeout", "5", "--no-control-socket",
                "gateway:create_app()",
            ],
            env=self.env(**env),
        )
        self.gateway_url = f"http://127.0.0.1:{port}"
        import requests

        wait_until(
            lambda: requests.get(self.gateway_url + "/healthz", timeout=1).status_code < 500,
            20,
            what="the gateway to answer /healthz",
        )
        return self.gateway_url

    # --- CLI ---------------------------------------------------------------------------------------
    def llmgw(self, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [python(), "-m", "llmgw", *args],
            env={**os.environ, **self.env(**env)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"llmgw {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def apply_catalog(self, yaml_text: str, name: str = "catalog.yaml") -> subprocess.CompletedProcess:
        path = self.root / name
        path.write_text(yaml_text)
        return self.llmgw("catalog", "apply", str(path))

    # --- teardown ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the agents first (their engines stop with them on SIGTERM), then everything else."""
        ordered = sorted(self.procs.procs, key=lambda p: (p.name == "redis", not p.name.startswith("node-")))
        for p in ordered:
            p.stop()

    def logs(self) -> str:
        return self.procs.logs()
