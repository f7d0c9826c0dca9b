"""A whole llmgw on real processes for integration and end-to-end tests.

    cluster = Cluster(tmp_path)           # nothing runs yet
    cluster.start_redis()                 # or cluster.start_sentinel_redis(): a master, a replica, 3 sentinels
    cluster.start_control(); cluster.start_beat()
    cluster.start_node("a"); cluster.start_node("b", gpus="h100:2")
    url = cluster.start_gateway()
    cluster.apply_catalog(yaml_text)
    ...
    cluster.stop()                        # every process, engines included

or all of that at once, the catalog applied once every node is live and waited for until routed:

    [url] = cluster.start_system(sim_catalog(replicas=2), nodes=("a", "b"), node_env=FAST_AGENT, routed=2)

Each process runs in its own session with its output in tmp_path/logs/<name>.log; `cluster.logs()`
returns their tails for assertion messages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Sequence
from pathlib import Path
from urllib.parse import quote

import redis
import yaml

from llmgw.local.embedded_redis import redis_server_argv
from llmgw.state.keys import BATCH_QUEUE, CONTROL_QUEUE, node_queue
from llmgw.state.store import Store, connect
from harness import needs
from harness.sentinel import SentinelRedis
from harness.procs import (
    TEST_PORT_RANGE,
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
    # Agents stop their engines when a test stops them (the default keeps engines across a restart).
    "LLMGW_AGENT_KEEP_ENGINES": "0",
    "PYTHONUNBUFFERED": "1",
}
# Node agents that react fast, so a test spends its time on what it checks, not on the agents' ticks.
FAST_AGENT = {"LLMGW_AGENT_TICK": "0.2", "LLMGW_AGENT_PROBE_INTERVAL": "0.3"}


def sim_catalog(replicas: int = 1, model: str = "chat", aliases: Sequence[str] = (), **profile) -> str:
    """A catalog of one model served by sim engines in one profile, `cpu`; `profile` adds its fields
    (capacity, args, drain_timeout, ...)."""
    spec = {"name": "cpu", "engine": "sim", "replicas": replicas, **profile}
    doc = {"name": model, **({"aliases": list(aliases)} if aliases else {}), "profiles": [spec]}
    return yaml.safe_dump({"models": [doc]}, sort_keys=False)


@dataclass(frozen=True)
class RedisTLS:
    """Certificate files for a TLS redis-server: a CA, and a server certificate it signed for 127.0.0.1."""

    ca: Path
    cert: Path
    key: Path


def make_certs(d: Path) -> RedisTLS:
    """A CA and a server certificate it signs for 127.0.0.1, with the openssl command."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=llmgw test CA")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "san.ext")
    return RedisTLS(ca=d / "ca.crt", cert=d / "server.crt", key=d / "server.key")


class Cluster:
    def __init__(self, tmp_path: Path, extra_env: dict[str, str] | None = None):
        self.root = Path(tmp_path)
        self.procs = ProcessSet(self.root / "logs")
        self.extra_env = dict(extra_env or {})
        self.redis_port: int | None = None
        self._redis: dict = {"persistent": False, "password": None, "tls": None, "binary": None,
                             "bind": ("127.0.0.1",)}
        self.gateway_url: str | None = None
        self.ha: SentinelRedis | None = None  # start_sentinel_redis's stack

    # --- environment -------------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        if self.ha is not None:
            return self.ha.url
        assert self.redis_port, "start_redis() first"
        opts = self._redis
        auth = f":{quote(opts['password'], safe='')}@" if opts["password"] else ""
        if opts["tls"]:
            return f"rediss://{auth}127.0.0.1:{self.redis_port}/0?ssl_cert_reqs=required&ssl_ca_certs={opts['tls'].ca}"
        return f"redis://{auth}127.0.0.1:{self.redis_port}/0"

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
    def start_redis(self, persistent: bool = False, password: str | None = None, tls: "RedisTLS | None" = None,
                    binary: str | None = None, bind: tuple[str, ...] = ("127.0.0.1",)) -> str:
        """A redis-server on a free loopback port. `persistent`: an append-only file fsynced every second,
        as `llmgw up`, the Procfile and compose run it (llmgw.local.embedded_redis); otherwise nothing is
        kept. `password` and `tls` (a RedisTLS: certificates made by the test) change `redis_url` to match;
        `bind` adds addresses (another network namespace's way in) to loopback. `binary`: another
        redis-server than the tests' (harness.procs.redis_server_binary)."""
        if tls is not None:
            needs.tls_redis(binary or redis_server_binary())
        self.redis_port = free_port()
        self._redis = {"persistent": persistent, "password": password, "tls": tls, "binary": binary, "bind": bind}
        self._start_redis_process()
        wait_until(lambda: self.redis().ping(), 15, what="redis-server to answer PING")
        return self.redis_url

    def start_sentinel_redis(self, password: str | None = None, persistent: bool = True,
                             tls: RedisTLS | None = None, binary: str | None = None, **kw) -> str:
        """Redis as production runs it (harness/sentinel.py): one master, one replica and three
        sentinels on free loopback ports; `redis_url` is then its `redis+sentinel://` URL, and `self.ha`
        kills, restarts and inspects its instances."""
        if tls is not None:
            needs.tls_redis(binary or redis_server_binary())
        self.ha = SentinelRedis(self.root / "ha", self.procs, password=password, persistent=persistent, tls=tls,
                                binary=binary, **kw)
        return self.ha.start()

    def _start_redis_process(self) -> None:
        data = self.root / "redis"
        data.mkdir(parents=True, exist_ok=True)
        opts = self._redis
        argv = redis_server_argv(self.redis_port, data, persistent=opts["persistent"])
        argv[0] = opts["binary"] or redis_server_binary()
        at = argv.index("--bind") + 1
        argv[at:at + 1] = list(opts["bind"])
        if opts["password"]:
            argv += ["--requirepass", opts["password"]]
        if opts["tls"]:
            t = opts["tls"]
            # TLS only: the plain port is closed, so a client that forgets TLS fails instead of passing.
            argv[argv.index("--port") + 1] = "0"
            argv += ["--tls-port", str(self.redis_port), "--tls-cert-file", str(t.cert), "--tls-key-file", str(t.key),
                     "--tls-ca-cert-file", str(t.ca), "--tls-auth-clients", "no"]
        self.procs.start("redis", argv)

    def stop_redis(self) -> None:
        self.procs.get("redis").stop()

    def kill_redis(self) -> None:
        """kill -9 the server: nothing is flushed (the append-only file holds what was fsynced)."""
        self.procs.get("redis").kill9()

    def restart_redis(self, wipe: bool = False) -> None:
        """Start redis again on the same port with the same options. Without persistence it comes back
        empty (tests use that for outages); `wipe` deletes its data first (a lost volume)."""
        if wipe:
            shutil.rmtree(self.root / "redis", ignore_errors=True)
        self._start_redis_process()
        wait_until(lambda: self.redis().ping(), 15, what="redis-server to answer PING again")

    def celery(self, *args: str) -> list[str]:
        return [bin_path("celery"), "-A", "workers", *args]

    def start_control(self, name: str = "control", concurrency: int = 4, **env: str):
        return self.procs.start(
            name,
            self.celery(
                "worker", "-Q", CONTROL_QUEUE, "-n", f"{name}@%h", "-P", "threads", "-c", str(concurrency),
                "--without-gossip", "--without-mingle", "-l", "info",
            ),
            env=self.env(**env),
        )

    def start_beat(self, name: str = "beat", **env: str):
        return self.procs.start(
            name,
            self.celery("beat", "-l", "info", "-s", str(self.root / f"{name}-schedule")),
            env=self.env(**env),
        )

    def start_node(self, name: str, gpus: str = "", pool: str = "", labels: str = "",
                   prefix: list[str] | None = None, **env: str):
        """A node agent: a Celery worker consuming node-<name>, with its own state dir and ports.
        `prefix` runs it under another command, e.g. `["ip", "netns", "exec", "h1"]`: another host."""
        lo, hi = free_port_range(40, TEST_PORT_RANGE)
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
            [*(prefix or []), *self.celery(
                "worker", "-Q", node_queue(name), "-n", f"{name}@%h", "-P", "threads", "-c", "2",
                "--without-gossip", "--without-mingle", "-l", "info",
            )],
            env=self.env(**node_env),
        )

    def start_batch_worker(self, name: str = "batch", concurrency: int = 2, **env: str):
        """A batch worker (`celery -A workers worker -Q batch`), sending lines to the first gateway
        started unless LLMGW_BATCH_GATEWAY_URL is given (docs/batch.md)."""
        if self.gateway_url and "LLMGW_BATCH_GATEWAY_URL" not in env:
            env["LLMGW_BATCH_GATEWAY_URL"] = self.gateway_url
        return self.procs.start(
            name,
            self.celery("worker", "-Q", BATCH_QUEUE, "-n", f"{name}@%h", "-P", "threads", "-c", str(concurrency),
                        "--without-gossip", "--without-mingle", "-l", "info"),
            env=self.env(**env),
        )

    def start_flower(self, port: int, **env: str):
        """Flower (`celery -A workers flower`) on loopback, as the Procfile runs it."""
        return self.procs.start(
            "flower", self.celery("flower", "--address=127.0.0.1", f"--port={port}"), env=self.env(**env))

    def start_gateway(self, port: int | None = None, name: str = "gateway", graceful_timeout: int = 5,
                      **env: str) -> str:
        """A gateway under gunicorn; several may run (give each its own `name`). Returns its URL; the
        first one started is also `self.gateway_url`. `graceful_timeout`: how long it lets open requests
        finish once told to stop (gunicorn's default config says 30 s; tests use 5)."""
        port = port or free_port()
        self.procs.start(
            name,
            # The one gunicorn config users run (gevent worker, readiness before the first request).
            [
                bin_path("gunicorn"), "-c", "python:gateway.gunicorn_conf",
                "-b", f"127.0.0.1:{port}", "--graceful-timeout", str(graceful_timeout),
                "gateway:create_app()",
            ],
            env=self.env(**{"LLMGW_GATEWAY_WORKERS": "1", **env}),
        )
        # With LLMGW_GATEWAY_CERTFILE the gateway serves HTTPS with that (self-signed) certificate.
        cert = env.get("LLMGW_GATEWAY_CERTFILE")
        url = f"{'https' if cert else 'http'}://127.0.0.1:{port}"
        self.gateway_url = self.gateway_url or url
        import requests

        wait_until(
            lambda: requests.get(url + "/healthz", timeout=1, verify=cert or True).status_code < 500,
            20,
            what=f"{name} to answer /healthz",
        )
        return url

    # --- a whole system ----------------------------------------------------------------------------
    def start_system(self, catalog: str | None = None, nodes: Sequence[str] = ("a",), gpus: str = "",
                     gateways: int = 1, routed: int | None = None, redis: dict | None = None,
                     node_env: dict[str, str] | None = None, control_env: dict[str, str] | None = None,
                     gateway_env: dict[str, str] | None = None) -> list[str]:
        """Redis (unless already started; `redis`: start_redis's options), the node agents (each with
        `gpus` and `node_env`), a control worker and beat (`control_env`), and `gateways` gateways
        (`gateway`, `gateway2`, ...; `gateway_env`). Every node is live before `catalog` is applied, so
        placement sees them all. With `routed`, waits until every gateway routes to that many endpoints.
        Returns the gateway URLs."""
        if self.redis_port is None and self.ha is None:
            self.start_redis(**(redis or {}))
        for name in nodes:
            self.start_node(name, gpus=gpus, **(node_env or {}))
        self.start_control(**(control_env or {}))
        self.start_beat(**(control_env or {}))
        urls = [self.start_gateway(name="gateway" if i == 0 else f"gateway{i + 1}", **(gateway_env or {}))
                for i in range(gateways)]
        store = self.store()
        wait_until(lambda: set(nodes) <= set(store.live_nodes()), 30, what=f"nodes {', '.join(nodes)} to be live")
        if catalog is not None:
            self.apply_catalog(catalog)
        if routed is not None:
            self.wait_routed(routed, urls)
        return urls

    def wait_routed(self, endpoints: int, urls: Sequence[str] | None = None, timeout: float = 90) -> None:
        """Wait until each gateway (`urls`, default the first one started) routes to `endpoints` endpoints."""
        import requests

        for url in urls if urls is not None else [self.gateway_url]:
            wait_until(lambda u=url: requests.get(u + "/healthz", timeout=2).json()["endpoints"] == endpoints,
                       timeout, what=f"{url} to route to {endpoints} endpoint(s)")

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
        def is_redis(name: str) -> bool:
            return name == "redis" or name.startswith(("redis-", "sentinel-"))

        ordered = sorted(self.procs.procs, key=lambda p: (is_redis(p.name), not p.name.startswith("node-")))
        for p in ordered:
            p.stop()

    def logs(self) -> str:
        return self.procs.logs()
