"""The bootstep that runs the node agent inside a node worker's main process.

A worker consuming a `node-<name>` queue is that node's agent; a worker consuming only `control` (or
other queues) runs no agent. The queues a worker consumes are known before bootsteps are built
(`WorkController.setup_queues` runs first), so the step decides in `__init__`. A worker told to consume
another node's queue (`-Q node-b` with LLMGW_NODE=a) fails at start-up: it would otherwise launch
node b's engines on node a.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path

from celery import bootsteps

from llmgw.errors import ConfigError
from llmgw.proc.portrange import ephemeral_warning
from llmgw.proc.ports import ephemeral_range
from llmgw.state.keys import NODE_QUEUE_PREFIX, node_queue

log = logging.getLogger("llmgw.agent")

def consumed_queues(app) -> list[str]:
    return sorted(app.amqp.queues.consume_from.keys())


def agent_queue(queues: list[str], node_name: str) -> str | None:
    """The node queue this worker consumes, if any; ConfigError if it names another node."""
    node_queues = [q for q in queues if q.startswith(NODE_QUEUE_PREFIX)]
    if not node_queues:
        return None
    expected = node_queue(node_name)
    wrong = [q for q in node_queues if q != expected]
    if wrong:
        raise ConfigError(
            "LLMGW_NODE",
            f"this worker consumes {', '.join(wrong)} but LLMGW_NODE is {node_name!r} "
            f"(expected only -Q {expected}); set LLMGW_NODE to match the queue",
        )
    return expected


def acquire_node_lock(state_dir, node: str):
    """Hold `<state_dir>/agent.lock` (flock) for the life of this process, so two agents can never
    supervise the same engines. The kernel drops the lock when the holder dies, even by kill -9, so a
    restarted agent takes over at once. ConfigError if another live agent holds it."""
    path = Path(state_dir) / "agent.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(
            "LLMGW_STATE_DIR",
            f"another node agent ({holder}) already supervises {path.parent}; stop it first or give "
            f"this one its own state dir",
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"node {node}, pid {os.getpid()}")
    f.flush()
    # A prefork pool's children share the open file (and so the lock): close it in them, or a pool
    # child outliving a killed agent would keep the next agent out.
    os.register_at_fork(after_in_child=f.close)
    return f


class _AgentService:
    """What the step starts and stops: the agent's threads in this process. Beside the loop, the
    heartbeat, the `/metrics` scraper and the weights' side pass (header reads, pulls) run in their own
    threads, so neither a slow Redis write nor a hung engine can stall supervision."""

    def __init__(self, app):
        # Imported here, not at the top: every Celery process (beat, control workers) loads this module
        # for the step, and only node workers run an agent.
        from llmgw.gpus import parse_class_map
        from workers.agent.config import AgentSettings
        from workers.agent.inventory import GpuHealth, discover_gpus, health_reader
        from workers.agent.loop import Agent
        from workers.agent.probe import HttpProber
        from llmgw.state.kicks import Kicker, celery_sender
        from workers.agent.runner import ShimRunner
        from workers.store_cache import STORES
        from llmgw.tracing import configure

        # The node agent's own settings; the app carries only the shared and control ones.
        settings = AgentSettings.from_env()
        parse_class_map(os.environ.get("LLMGW_GPU_CLASS_MAP", ""))  # a typo stops the agent here
        self.lock_file = acquire_node_lock(settings.state_dir, settings.node_name)
        # The worker process's one Redis client, shared with the launch/stop tasks and closed at
        # worker shutdown (after this service has stopped).
        store = STORES.get(settings.redis_url, settings.durability)
        self.kicker = Kicker(store, celery_sender(app), enabled=settings.event_driven)
        gpus = discover_gpus(settings.node_gpus)
        reader = health_reader(settings.node_gpus) if gpus else None
        node = settings.node_name
        health = GpuHealth(reader, lambda kind, msg: store.emit(kind, msg, source=f"agent:{node}", node=node)) \
            if reader else None
        self.agent = Agent(
            settings, store, ShimRunner(settings.state_dir, settings.log_max_bytes, settings.log_keep),
            HttpProber(), gpus=gpus, kick=self.kicker.kick, gpu_health=health,
            tracing=configure("llmgw-agent"),  # the worker's main process runs the loop: once, here
        )
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        from workers.agent.scrape import Scraper  # (node workers only, as above)

        a = self.agent
        scraper = Scraper(a.store, a.prober, lambda: a.targets, a.settings, a.clock)
        for name, target in (("llmgw-agent-loop", self._run_loop), ("llmgw-agent-heartbeat", self._run_heartbeat),
                             ("llmgw-agent-scrape", lambda: scraper.run(a.stopping)),
                             ("llmgw-agent-weights", self._run_weights)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self.threads.append(t)
        log.info("node agent for %s started (port range %s, state dir %s)", a.node, a.settings.port_range,
                 a.settings.state_dir)
        warning = ephemeral_warning("LLMGW_PORT_RANGE", a.settings.port_range, ephemeral_range())
        if warning:
            log.warning("%s", warning)

    def _run_loop(self) -> None:
        a = self.agent
        failing_since: float | None = None
        while not a.stopping.is_set():
            try:
                a.tick()
                if failing_since is not None:
                    log.info("agent passes succeed again after %.1fs", a.clock.monotonic() - failing_since)
                    failing_since = None
            except Exception as e:  # noqa: BLE001 - e.g. Redis down: log, wait, try again
                # Engines keep running while Redis is away; say so once, then every 30 s, not every tick.
                if failing_since is None:
                    failing_since = a.clock.monotonic()
                    log.exception("agent pass failed; engines are left as they are until it succeeds")
                else:
                    a.warn("*", f"agent passes still failing: {e}", interval=30)
                a.stopping.wait(a.settings.tick)
                continue
            try:
                a.store.wait_for_wake(a.node, a.next_wait())  # a launch/stop task ends the wait early
            except Exception:  # noqa: BLE001
                a.stopping.wait(a.settings.tick)

    def _run_heartbeat(self) -> None:
        from llmgw.state.kicks import RECONCILE  # (node workers only, as above)

        a = self.agent
        failing = False
        joined = False
        while not a.stopping.is_set():
            try:
                a.heartbeat()
                failing = False
                if not joined:
                    # A node that (re)joins can take replicas, and its own may be Lost no more.
                    joined = True
                    a.store.emit("node_joined", f"agent pid {os.getpid()} started", source=f"agent:{a.node}",
                                 node=a.node)
                    self.kicker.kick(RECONCILE)
            except Exception as e:  # noqa: BLE001
                if not failing:
                    log.exception("heartbeat failed")
                else:
                    a.warn("*", f"heartbeats still failing: {e}", interval=30)
                failing = True
            a.stopping.wait(a.settings.heartbeat_interval)

    def _run_weights(self) -> None:
        """The header reads placement waits for and `llmgw models pull`, every heartbeat interval."""
        a = self.agent
        while not a.stopping.is_set():
            try:
                a.weights_pass()
            except Exception as e:  # noqa: BLE001 - e.g. Redis down: the next round tries again
                a.warn("*", f"weights pass failed: {e}", interval=30)
            a.stopping.wait(a.settings.heartbeat_interval)

    def stop(self) -> None:
        """Stop the threads; unless LLMGW_AGENT_KEEP_ENGINES, stop this node's engines (SIGTERM, then
        SIGKILL)."""
        a = self.agent
        if a.stopping.is_set():
            return
        a.stopping.set()
        if not self.threads:
            return  # never started: the engines on this node are not ours to stop
        for t in self.threads:
            t.join(a.settings.tick + a.settings.heartbeat_interval + 2)
        a.close()
        if a.settings.keep_engines:
            log.info("agent stopping; engines keep running (LLMGW_AGENT_KEEP_ENGINES)")
            return
        a.stop_engines()

    terminate = stop


class AgentStep(bootsteps.StartStopStep):
    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        settings = worker.app.settings
        try:
            self.queue = agent_queue(consumed_queues(worker.app), settings.node_name)
        except ConfigError as e:
            # Refuse to start, with one clear line rather than a traceback.
            raise SystemExit(f"llmgw node agent: {e}") from None
        self.enabled = self.queue is not None

    def create(self, worker):
        log.info("starting the node agent for %s (queue %s)", worker.app.settings.node_name, self.queue)
        try:
            return _AgentService(worker.app)
        except ConfigError as e:  # e.g. a malformed LLMGW_NODE_GPUS or LLMGW_AGENT_* value
            raise SystemExit(f"llmgw node agent: {e}") from None
