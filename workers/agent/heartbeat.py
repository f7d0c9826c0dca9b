"""The node's heartbeat: what this node has (CPU, memory, GPUs and their health, the weights cache)
written with a TTL, from the agent's own thread (workers.agent.step), so a slow Redis write never
stalls supervision. A node whose heartbeat expires is Lost to the control plane."""

from __future__ import annotations

from typing import Any, Callable

from llmgw.state.clock import Clock
from llmgw.state.node_records import GPUDevice
from llmgw.state.store import Store
from workers.agent.config import AgentSettings
from workers.agent.inventory import node_info


class Heartbeat:
    def __init__(self, settings: AgentSettings, store: Store, clock: Clock, gpus: tuple[GPUDevice, ...],
                 gpu_health: Any, cache_report: Callable[[], Any]):
        self.settings, self.store, self.clock = settings, store, clock
        self.gpus, self.gpu_health = gpus, gpu_health  # `gpu_health`: inventory.GpuHealth, or None
        self.cache_report = cache_report  # the weights cache (weights.NodeWeights.report)
        self.started_at = clock.time()

    def beat(self) -> None:
        now = self.clock.time()
        gpus = self.gpu_health.step(self.gpus, now) if self.gpu_health is not None else self.gpus
        info = node_info(self.settings, gpus, self.started_at, now, self.cache_report())
        self.store.write_heartbeat(info, self.settings.heartbeat_ttl)
