"""The Batch API's metrics, with the fleet's on `GET /metrics/fleet` (docs/batch.md, docs/monitoring.md):
computed from Redis like them, so every gateway answers the same figures (scrape one, or `max`).

`batch_families(active, ended)` is pure: the batches not ended yet and the final counts in, the metric
families out."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.state.batch_records import ENDED, STATUSES, BatchRecord

# name -> (type, help, labels)
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llmgw_batches": ("gauge", "Batches not ended yet, by status", ("status",)),
    "llmgw_batches_ended": ("counter", "Batches that ended, by final status", ("status",)),
    "llmgw_batch_requests": ("gauge", "Lines of the batches not ended yet: answered (completed), failed, or "
                                      "waiting to be answered", ("state",)),
}


def batch_families(active: list[BatchRecord], ended: dict[str, int]) -> list[Metric]:
    running = GaugeMetricFamily("llmgw_batches", FAMILIES["llmgw_batches"][1], labels=["status"])
    done = CounterMetricFamily("llmgw_batches_ended", FAMILIES["llmgw_batches_ended"][1], labels=["status"])
    lines = GaugeMetricFamily("llmgw_batch_requests", FAMILIES["llmgw_batch_requests"][1], labels=["state"])
    by_status = {s: 0 for s in STATUSES if s not in ENDED}
    for b in active:
        if b.status in by_status:
            by_status[b.status] += 1
    for status, n in by_status.items():
        running.add_metric([status], n)
    for status in sorted(ENDED):
        done.add_metric([status], ended.get(status, 0))
    live = [b for b in active if not b.ended]
    lines.add_metric(["completed"], sum(b.n_completed for b in live))
    lines.add_metric(["failed"], sum(b.n_failed for b in live))
    lines.add_metric(["waiting"], sum(max(0, b.total - b.done) for b in live))
    return [running, done, lines]


class _Collector:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


def render(active: list[BatchRecord], ended: dict[str, int]) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(batch_families(active, ended)))  # type: ignore[arg-type]
    return generate_latest(reg)
