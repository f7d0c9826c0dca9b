"""One catalog apply followed to the engine it started, in one trace (docs/tracing.md): the real CLI,
control worker, beat and node agent, each exporting over OTLP to a collector stand-in. The apply's
span is the parent of the reconcile it kicks (Celery task headers), that pass is the parent of the
launch on the node (the replica record's traceparent), the engine process is handed the launch as
its parent (TRACEPARENT in its environment), and its start up to Ready is the launch's child."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.state import keys
from harness.cluster import FAST_AGENT, sim_catalog
from tests.support.otlp import attribute, collector  # noqa: F401 - collector: a fixture
from harness.procs import wait_until

pytestmark = pytest.mark.slow


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def test_a_catalog_apply_is_one_trace_down_to_the_engine_it_started(cluster, collector):
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    # Beat's reconcile timer far away: the pass that creates the replica is the one the apply kicks.
    cluster.start_system(nodes=("a",), gateways=0, node_env={**FAST_AGENT, **otel},
                         control_env={**otel, "LLMGW_RECONCILE_INTERVAL": "60"})
    store = cluster.store()
    # A kick already on its way (a node joining kicks one) would take the apply's kick into it.
    wait_until(lambda: not store.r.exists(keys.kick_scheduled("llmgw.reconcile")), 10, what="no kick on its way")
    path = cluster.root / "catalog.yaml"
    path.write_text(sim_catalog(replicas=1))
    cluster.llmgw("catalog", "apply", str(path), **otel)

    wait_until(lambda: collector.named("llmgw.catalog_apply"), 15, what="the apply's span")
    ((apply_service, apply),) = collector.named("llmgw.catalog_apply")
    assert apply_service == "llmgw" and attribute(apply, "llmgw.catalog.changed") is True
    trace = apply.trace_id

    def in_trace(name):
        return [(svc, s) for svc, s in collector.named(name) if s.trace_id == trace]

    wait_until(lambda: in_trace("llmgw.launch"), 60, what=f"the launch's span in the apply's trace\n{cluster.logs()[-3000:]}")
    ((rec_service, reconcile),) = in_trace("llmgw.reconcile")
    assert rec_service == "llmgw-control" and reconcile.parent_span_id == apply.span_id
    assert attribute(reconcile, "llmgw.pass.applied") >= 1
    ((launch_service, launch),) = in_trace("llmgw.launch")
    assert launch_service == "llmgw-agent" and launch.parent_span_id == reconcile.span_id
    (rec,) = store.all_replicas()
    assert attribute(launch, "llmgw.replica") == rec.id and attribute(launch, "llmgw.node") == "a"
    assert rec.traceparent == f"00-{trace.hex()}-{reconcile.span_id.hex()}-01"
    wait_until(lambda: store.get_replica(rec.id).engine_pid, 30, what="the engine's pid")
    env = environ_of(store.get_replica(rec.id).engine_pid)
    assert env["TRACEPARENT"] == f"00-{trace.hex()}-{launch.span_id.hex()}-01"
    # the engine's start, from its spawn to Ready, seen by the agent's loop: the launch's child
    wait_until(lambda: in_trace("llmgw.engine_start"), 30, what="the engine's start in the apply's trace")
    ((_, ready),) = in_trace("llmgw.engine_start")
    assert ready.parent_span_id == launch.span_id and attribute(ready, "llmgw.replica") == rec.id
    assert ready.end_time_unix_nano > ready.start_time_unix_nano
    assert attribute(ready, "llmgw.url") == store.get_replica(rec.id).url
    # the passes beat runs on its own are spans too, each the root of a trace of its own
    wait_until(lambda: collector.named("llmgw.publish"), 10, what="a publish pass's span")
    assert {svc for svc, _ in collector.named("llmgw.publish")} == {"llmgw-control"}
