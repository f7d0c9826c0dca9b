"""`llmgw up`: the whole system on this machine.

Starts Redis (embedded unless REDIS_URL is set; data in the state directory, appendonly on), a control
worker, beat, one node agent and the gateway (Redis and the engines on a free block of
LLMGW_UP_PORT_RANGE, outside the kernel's ephemeral range: llmgw.proc.portrange); applies
`--catalog FILE` or the default catalog (`llmgw/default_catalog.yaml`: a real llama.cpp replica),
saying which file and how to copy it; shows a progress line per replica until a model is Ready, then
prints the gateway URL, a curl line, the console's URL and the Redis URL to export in other shells
(commands run from the same directory, or with LLMGW_STATE_DIR, find it by themselves:
llmgw.local.stackfile); Ctrl-C (SIGINT or SIGTERM) stops every process it started, engines included.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import requests

from llmgw.catalog import Catalog, apply_catalog, load_catalog_file, parse_catalog
from llmgw.cli.common import kick, replicated
from llmgw.cli.progress import Progress, Ticker
from llmgw.errors import CatalogInvalid, ConfigError, LlmgwError
from llmgw.local import stackfile
from llmgw.local.embedded_redis import redis_server_argv
from llmgw.local.localstack import LocalStack, celery_argv, port_is_free, python_module, wait_for
from llmgw.proc.portrange import ephemeral_warning
from llmgw.proc.ports import ephemeral_range, free_port_range
from llmgw.settings import Settings, parse_port_range
from llmgw.engines.selfcheck import advice
from llmgw.state.records import ReplicaRecord
from llmgw.state.replica_state import State, derive, nodes_alive
from llmgw.state.keys import BATCH_QUEUE, CONTROL_QUEUE, node_queue
from llmgw.state.kicks import RECONCILE
from llmgw.state.store import Durability, Store, connect


def register(sub) -> None:
    p = sub.add_parser("up", help="run the whole system on this machine (Ctrl-C stops everything)")
    p.add_argument("--port", type=int, default=8080, help="gateway port on 127.0.0.1 (default 8080)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--catalog", help="catalog YAML to apply (default: llmgw/default_catalog.yaml, llama.cpp "
                                     "serving SmolLM2 on this CPU)")
    p.add_argument("--state-dir", help="logs, engine state and Redis data (default: LLMGW_STATE_DIR or ./.llmgw)")
    p.add_argument("--node", help="this node's name (default: LLMGW_NODE or the host name)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the first Ready replica before giving up (default 600)")
    p.set_defaults(func=cmd_up)


def default_catalog_path() -> str:
    """The file of the catalog `llmgw up` applies when not given one (shipped in the package)."""
    return str(resources.files("llmgw").joinpath("default_catalog.yaml"))


def default_catalog() -> Catalog:
    return load_catalog_file(default_catalog_path())


def catalog_lines(path: str, given: bool, models: list[str], version: int, changed: bool = True) -> list[str]:
    """What `llmgw up` says of the catalog it applied: its version, which file, and, for the default
    one, how to serve other models from a copy of it."""
    names = ", ".join(models) or "no model"
    head = f"catalog version {version}{'' if changed else ' (unchanged)'}"
    if given:
        return [f"{head}: {path} ({names}); change it with `llmgw catalog apply FILE` while this runs"]
    return [f"{head}: the default catalog {path} ({names}); to serve other models, copy it and edit the copy:",
            f"\n  cp {shlex.quote(path)} my-catalog.yaml\n",
            "  then `llmgw catalog apply my-catalog.yaml` while this runs, or `llmgw up --catalog my-catalog.yaml` "
            "next time (docs/catalog.md)\n"]


def _say(msg: str) -> None:
    print(f"llmgw up: {msg}", flush=True)


# The ports `llmgw up` takes from LLMGW_UP_PORT_RANGE: one block, its Redis on the first port (which
# then tells another `llmgw up` that the block is held) and its engines on the rest.
UP_BLOCK = 100


def engine_port_range(environ) -> tuple[int, int] | None:
    """LLMGW_PORT_RANGE when the user set it (the engines then take that range as is)."""
    value = environ.get("LLMGW_PORT_RANGE")
    if not value:
        return None
    try:
        return parse_port_range(value)
    except ValueError as e:
        raise ConfigError("LLMGW_PORT_RANGE", str(e)) from None


def port_warnings(up_range, engines, embedded_redis: bool, ephemeral) -> list[str]:
    """What `llmgw up` says of the ranges it takes ports from that overlap the kernel's ephemeral range."""
    ranges = [("LLMGW_UP_PORT_RANGE", up_range)] if embedded_redis or engines is None else []
    ranges += [("LLMGW_PORT_RANGE", engines)] if engines is not None else []
    return [w for variable, r in ranges if (w := ephemeral_warning(variable, r, ephemeral))]


def cmd_up(args) -> int:
    settings = Settings.from_env()
    # Validate everything before starting anything: a bad file changes nothing.
    try:
        catalog = load_catalog_file(args.catalog) if args.catalog else default_catalog()
    except CatalogInvalid as e:
        for p in e.problems:
            print(f"{e.source}: {p}", file=sys.stderr)
        return 2
    if not port_is_free(args.port):
        raise LlmgwError(f"port {args.port} is already in use; pick another with --port")
    engines = engine_port_range(os.environ)
    for warning in port_warnings(settings.up_port_range, engines, "redis_url" not in settings.model_fields_set,
                                 ephemeral_range()):
        _say(f"warning: {warning}")
    state_dir = Path(args.state_dir or settings.state_dir).resolve()
    node = args.node or settings.node_name
    running, _stale = stackfile.running_stack(state_dir)
    if running is not None and _stale is None:
        raise LlmgwError(f"llmgw up already runs in {state_dir} (pid {running.pid}, gateway {running.gateway_url}); "
                         "stop it first, or give this one another --state-dir")

    stopping = threading.Event()

    def on_signal(signum, _frame):
        if not stopping.is_set():
            _say(f"received {signal.Signals(signum).name}, stopping everything ...")
        stopping.set()

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = LocalStack(state_dir, env={})
    try:
        return _run(args, settings, catalog, state_dir, node, stack, stopping, engines)
    finally:
        stack.stop_all()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        _say("stopped")


def _run(args, settings, catalog, state_dir, node, stack: LocalStack, stopping, engines) -> int:
    if "redis_url" in settings.model_fields_set:  # REDIS_URL or LLMGW_REDIS_URL was given
        redis_url = settings.redis_url
        _say(f"using Redis at {stackfile.masked(redis_url)}")
        store = _store(redis_url, settings)
        if not wait_for(store.ping, 20, stopping.is_set):
            raise LlmgwError(f"Redis at {redis_url} did not answer within 20 s")
        # The engines' ports: the range given, or a free block of LLMGW_UP_PORT_RANGE.
        engines = engines or free_port_range(UP_BLOCK, settings.up_port_range)
    else:
        redis_url, store, block = _start_redis(stack, settings, state_dir, 1 if engines else UP_BLOCK, stopping)
        engines = engines or (block[0] + 1, block[1])
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{args.port}"
    stack.announce(redis_url, url)

    stack.env.update({
        "REDIS_URL": redis_url,
        "LLMGW_STATE_DIR": str(state_dir),
        "LLMGW_NODE": node,
        # Ctrl-C stops the whole system here, engines included.
        "LLMGW_AGENT_KEEP_ENGINES": "0",
        # Plain HTTP on this machine (its readiness check and curl line are http://): TLS is for the
        # fleet's gateways (docs/gateway.md); an empty variable is an unset one.
        "LLMGW_GATEWAY_CERTFILE": "", "LLMGW_GATEWAY_KEYFILE": "",
        # The batch worker sends the Batch API's lines to this gateway (docs/batch.md).
        "LLMGW_BATCH_GATEWAY_URL": url,
    })
    # The engines' ports from a block free now, not the agent's fixed default (21000-21999): a second
    # `llmgw up` on the machine (or a test beside it) handed a vLLM replica's port, still unbound while
    # vLLM loads for a minute, to its own llama-server. The block's Redis keeps others off it.
    stack.env["LLMGW_PORT_RANGE"] = f"{engines[0]}-{engines[1]}"
    common = ["--without-gossip", "--without-mingle", "-l", "info"]
    stack.start("control", celery_argv("worker", "-Q", CONTROL_QUEUE, "-n", "control@%h", "-P", "threads", "-c", "4",
                                       *common))
    stack.start("beat", celery_argv("beat", "-l", "info", "-s", str(state_dir / "beat-schedule")))
    stack.start("node", celery_argv("worker", "-Q", node_queue(node), "-n", f"{node}@%h", "-P", "threads", "-c", "2", *common))
    stack.start("batch", celery_argv("worker", "-Q", BATCH_QUEUE, "-n", "batch@%h", "-P", "threads", "-c", "4", *common))
    # The gateway's one gunicorn config (gateway/gunicorn_conf.py); the flag overrides its bind.
    stack.start("gateway", python_module(
        "gunicorn", "-c", "python:gateway.gunicorn_conf", "-b", f"{args.host}:{args.port}", "gateway:create_app()",
    ))
    _say(f"started control worker, beat, node agent {node!r}, batch worker and the gateway; logs in {state_dir / 'logs'}")

    path = os.path.abspath(args.catalog) if args.catalog else default_catalog_path()
    version, changed = replicated(lambda: apply_catalog(
        store, catalog, source=path, applied_by=f"{getpass.getuser()}@{socket.gethostname()} (llmgw up)",
    ))
    first, *rest = catalog_lines(path, bool(args.catalog), [m.name for m in catalog.models], version, changed)
    _say(first)
    for line in rest:
        print(line, flush=True)
    kick(Settings.from_env({**os.environ, **stack.env}), store, RECONCILE)

    names = [m.name for m in catalog.models]
    crashes = CrashReporter(catalog)
    ready_model = _wait_first_ready(url, names, store, stack, stopping, args.ready_timeout, crashes)
    if ready_model is None:
        return 0 if stopping.is_set() else 1
    body = json.dumps({"model": ready_model, "messages": [{"role": "user", "content": "Say hello"}]})
    _say(f"ready: the gateway answers at {url}")
    print(f"\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'\n", flush=True)
    _say(f"the console (fleet, models, events, catalog): {url}/ui")
    _say(f"{found_by(state_dir, Path.cwd())}; in other shells:")
    print(f"\n  {export_line(redis_url, state_dir)}\n", flush=True)
    _say("press Ctrl-C to stop")
    while not stopping.wait(0.5):
        dead = stack.dead_child()
        if dead:
            _say(f"{dead.name} exited with code {dead.popen.returncode}; last log lines:\n{dead.log_tail()}")
            return 1
        for text in crashes.check(store):
            _say(text)
    return 0


def _store(redis_url: str, settings: Settings) -> Store:
    durability = Durability.of(redis_url, settings.redis_wait_replicas, settings.redis_wait_timeout)
    return Store(connect(redis_url), durability)


def _start_redis(stack: LocalStack, settings: Settings, state_dir: Path, size: int, stopping,
                 tries: int = 3) -> tuple[str, Store, tuple[int, int]]:
    """The embedded Redis, on the first port of a free block of `size` ports of LLMGW_UP_PORT_RANGE.
    A Redis that exits before it answers lost its port between the probe and its bind (another
    process took it): it starts again on another block. Returns its URL, its store and the block."""
    data = state_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    log = state_dir / "logs" / "redis.log"
    tried: set[int] = set()
    for _ in range(tries):
        block = free_port_range(size, settings.up_port_range, taken=tried)
        port = block[0]
        child = stack.start("redis", redis_server_argv(port, data, persistent=True))
        redis_url = f"redis://127.0.0.1:{port}/0"
        store = _store(redis_url, settings)
        if wait_for(store.ping, 20, lambda: stopping.is_set() or not child.alive()):
            _say(f"started Redis on 127.0.0.1:{port} (data in {data})")
            return redis_url, store, block
        if stopping.is_set() or child.alive():
            raise LlmgwError(f"Redis on 127.0.0.1:{port} did not answer within 20 s; see {log}")
        last = (child.log_tail(1) or f"exit code {child.popen.returncode}").strip()
        _say(f"Redis exited on port {port} ({last}); trying another block of LLMGW_UP_PORT_RANGE")
        stack.forget(child)
        tried.update(range(block[0], block[1] + 1))
    raise LlmgwError(f"Redis exited {tries} times at start, on ports {sorted(tried)[::size]}; see {log}")


def found_by(state_dir: Path, cwd: Path) -> str:
    """Which `llmgw` commands find this stack without being told (llmgw.cli.common.stack_dirs)."""
    if state_dir == (cwd / ".llmgw").absolute():
        return f"llmgw commands run from {cwd} find this stack by themselves"
    return f"llmgw commands run with LLMGW_STATE_DIR={shlex.quote(str(state_dir))} find this stack by themselves"


def export_line(redis_url: str, state_dir: Path) -> str:
    """The line to paste in another shell; a password is not printed (the stack file, mode 0600, has it)."""
    shown = stackfile.masked(redis_url)
    line = f"export LLMGW_REDIS_URL={shlex.quote(shown)}"
    if shown != redis_url:
        line += f"   # password elided: it is in {stackfile.stack_path(state_dir)}"
    return line


def _wait_first_ready(url, names: list[str], store: Store, stack: LocalStack, stopping, timeout: float,
                      crashes: CrashReporter) -> str | None:
    """Wait until the gateway lists one of the catalog's models (by its canonical name, for the curl
    line); show a progress line per replica meanwhile (llmgw.cli.progress), and each crash loop once."""
    deadline = time.monotonic() + timeout
    progress = Progress(prefix="llmgw up: ")
    ticker = Ticker(progress, store)
    while time.monotonic() < deadline and not stopping.is_set():
        for text in crashes.check(store):
            progress.say(text)
        dead = stack.dead_child()
        if dead:
            progress.say(f"{dead.name} exited with code {dead.popen.returncode}; last log lines:\n{dead.log_tail()}")
            return None
        try:
            resp = requests.get(url + "/v1/models", timeout=2)
            listed = {m["id"] for m in resp.json().get("data", [])} if resp.ok else set()
            ready = [n for n in names if n in listed]
            if ready:
                ticker.tick(force=True)
                return ready[0]
        except (requests.RequestException, ValueError):
            pass
        ticker.tick()
        stopping.wait(0.5)
    if not stopping.is_set():
        progress.say(f"no replica became Ready within {timeout:.0f} s; see the logs above and in the state directory")
    return None


def crash_loop_text(rec: ReplicaRecord, reason: str, engine: str, lines: int = 15) -> str:
    """What `llmgw up` says, once, when a replica reaches CrashLoop: why, the end of its engine log
    (kept in the record: the node may be this machine or not) and what to do."""
    out = [f"replica {rec.id} ({rec.model}/{rec.profile}) is crash-looping: {reason}"]
    tail = [ln for ln in (rec.log_tail or "").splitlines() if ln.strip()][-lines:]
    if tail:
        out.append("last lines of its engine log:")
        out += ["  " + ln for ln in tail]
    if engine == "llamacpp":
        out.append(advice(rec.exit_signal or (-rec.exit_code if rec.exit_code and rec.exit_code < 0 else None)))
    else:
        out.append("see `llmgw logs " + rec.id + "` and docs/engines.md")
    return "\n".join(out)


class CrashReporter:
    """Tells about each replica that reaches CrashLoop once (not on every progress line)."""

    def __init__(self, catalog: Catalog):
        self.engines = {(m.name, p.name): p.engine for m, p in catalog.profiles()}
        self.told: set[str] = set()

    def check(self, store: Store) -> list[str]:
        try:
            live, now = store.live_nodes(), time.time()
            out = []
            for rec in store.all_replicas():
                view = derive(rec, nodes_alive(rec, live), now)
                if view.state is State.CRASHLOOP and rec.id not in self.told:
                    self.told.add(rec.id)
                    out.append(crash_loop_text(rec, view.reason, self.engines.get((rec.model, rec.profile), "")))
            return out
        except Exception:  # noqa: BLE001 - progress output only
            return []

