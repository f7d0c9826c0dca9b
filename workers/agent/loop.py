"""The node agent: a level-based loop that turns this node's replica records into serving processes.

`Agent` wires the agent's parts and runs its pass (`Agent.tick`), which observes, decides and acts:
1. observe (`observe.Observer`): the records on this node (one read), the attempts in the state dir
   (one look), each running attempt's process (the runner seam) and the `/health` probes
   `supervisor.due_probes` says are due (`probe.HealthProbes`, concurrently);
2. decide: `workers.agent.supervisor.decide` returns the actions, each carrying the facts to record;
3. act (`act.Actor`): every record written once, in one pipeline (`record.Recorder`), the starts'
   intents included, then the signals and spawns, then the spawned pids.
Each part has one role: what the agent remembers between passes (`memory.Memory`), the LoRA adapters
of Ready replicas (`adapterkeeper.AdapterKeeper`, whose facts join the pass's one write), the weights
(`weights.NodeWeights`), the heartbeat (`heartbeat.Heartbeat`), the scrape targets the pass leaves
for the scraper (`scrape.Scraper`), and stopping the engines (`shutdown.stop_engines`, given a
`Shutdown`, not the agent). The loop never dies: a replica that cannot be observed or acted on is
logged with its id and skipped. The loop's thread, the heartbeat's, the scraper's and the weights'
are run by `step.py`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from llmgw.proc.ports import can_bind
from llmgw.state.clock import Clock
from llmgw.state.node_records import GPUDevice
from llmgw.state.store import Store
from llmgw.tracing import OFF
from workers.agent import supervisor as sv
from workers.agent.act import Actor
from workers.agent.adapterkeeper import AdapterKeeper
from workers.agent.config import AgentSettings
from workers.agent.heartbeat import Heartbeat
from workers.agent.inventory import core_ids, memory_mb
from workers.agent.launch import CatalogCache, Launcher
from workers.agent.memory import Memory
from workers.agent.observe import Observer
from workers.agent.probe import HealthProbes
from workers.agent.record import Recorder
from workers.agent.scrape import ScrapeTarget
from workers.agent.shutdown import Shutdown, stop_engines
from workers.agent.throttle import Warner
from workers.agent.weights import NodeWeights


class Agent:
    def __init__(self, settings: AgentSettings, store: Store, runner: Any, prober: Any, clock: Clock | None = None,
                 gpus: tuple[GPUDevice, ...] = (), bindable=None, sleep=None,
                 kick: Callable[[str], object] = lambda task: None, weights: NodeWeights | None = None,
                 gpu_health: Any = None, tracing: Any = None, cores: tuple[int, ...] | None = None,
                 node_memory_mb: int | None = None):
        self.settings, self.store, self.runner, self.prober = settings, store, runner, prober
        self.clock = clock or Clock()
        self.node = node = settings.node_name
        self.policy = settings.policy
        tracing = tracing if tracing is not None else OFF  # llmgw.tracing: each launch is a span
        self.stopping = threading.Event()  # set when the agent shuts down (workers.agent.step)
        self.starting = False  # an attempt is starting: pass again soon (`next_wait`)
        self.warn = Warner(self.clock.monotonic)
        self.catalog = CatalogCache(store, self.clock)
        self.launcher = Launcher(settings, store, self.catalog, gpus,
                                 bindable or (lambda port: can_bind(settings.engine_host, port)),
                                 cores=core_ids() if cores is None else cores,
                                 memory_mb=memory_mb() if node_memory_mb is None else node_memory_mb)
        self.adapters = AdapterKeeper(store, self.catalog, node, prober, kick, settings.adapter_timeout,
                                      settings.adapter_unload_grace)
        # Downloads, header reads and pulls (workers.agent.weights).
        self.weights = weights or NodeWeights.for_agent(settings, store, kick)
        self.probes = HealthProbes(prober, settings.probe_timeout)
        self.memory = memory = Memory()
        self.observer = Observer(node, store, runner, self.launcher, self.catalog, self.weights, self.probes, memory,
                                 self.policy, settings.dir_retention, self.warn)
        recorder = Recorder(node, store, runner, memory, tracing, kick)
        self.actor = Actor(node, store, runner, self.launcher, recorder, self.adapters, self.weights, memory,
                           self.policy, tracing, self.stopping, self.warn)
        self.beats = Heartbeat(settings, store, self.clock, gpus, gpu_health, self.weights.report)
        # Waiting during shutdown goes through the clock too (a fake clock's `sleep` advances it).
        self.shutdown = Shutdown(node, runner, self.observer.part_views, recorder.record, self.policy, self.clock,
                                 sleep or getattr(self.clock, "sleep", None) or time.sleep)

    def tick(self) -> list[sv.Action]:
        """One pass of the loop. Returns the actions decided (for tests and logs)."""
        now = self.clock.time()
        seen = self.observer.observe(now)
        actions = sv.decide(seen.views, seen.observed, list(seen.rest.orphans), now, self.policy, self.node)
        self.actor.act(seen, actions, now)
        observed = seen.observed
        self.starting = any(observed[v.id].alive and observed[v.id].has_health and not sv.ready_this_attempt(v)
                            and v.stop_requested_at is None for v in seen.views)
        return actions

    @property
    def targets(self) -> list[ScrapeTarget]:
        """What the scraper reads: Ready heads, as the last pass left them."""
        return self.actor.targets

    def next_wait(self) -> float:
        """How long the loop may wait for a wake-up before the next pass."""
        return min(self.settings.tick, self.settings.start_probe_interval) if self.starting else self.settings.tick

    def heartbeat(self) -> None:
        self.beats.beat()

    def weights_pass(self) -> None:
        """Read the headers placement waits for, and serve `llmgw models pull` (its own thread)."""
        self.weights.side_pass(self.catalog.get())

    def close(self) -> None:
        self.probes.close()
        self.weights.close()
        self.adapters.close()

    def stop_engines(self) -> None:
        """Stop every engine on this node and record the exits (workers.agent.shutdown)."""
        stop_engines(self.shutdown)
