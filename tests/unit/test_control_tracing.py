"""The control plane's trace context (docs/tracing.md), hop by hop: a kick carries its carrier as task
headers, a reconcile pass stores its traceparent with the records it creates or places, and the
agent's launch of a record is that pass's child and hands itself to the engine's environment.
(The whole chain through real processes: tests/integration/test_control_tracing.py.)"""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from llmgw.engines.base import LaunchSpec
from llmgw.state.kicks import Kicker
from llmgw.state.records import ReplicaRecord
from llmgw.tracing import NO_SPAN, OFF
from tests.support.clock import FakeClock
from tests.unit.control_support import catalog, cpu_profile, gpu_profile, model, node
from tests.unit.test_control_apply import FakeDispatcher, setup
from workers.agent.launch import Launch, launch_span, ready_span
from workers.control.apply import reconcile_once

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_kick_sends_its_carrier_as_task_headers_and_a_folded_kick_sends_nothing(store):
    sent = []
    k = Kicker(store, lambda task, countdown, *headers: sent.append((task, headers)))
    assert k.kick("llmgw.reconcile", {"traceparent": TP})
    assert not k.kick("llmgw.reconcile", {"traceparent": TP})  # one on its way already: folded into it
    k.started("llmgw.reconcile")
    assert k.kick("llmgw.reconcile")
    # with a carrier the sender gets it; without one it is called as before (task, countdown)
    assert sent == [("llmgw.reconcile", ({"traceparent": TP},)), ("llmgw.reconcile", ())]


def test_a_reconcile_pass_stores_its_traceparent_with_the_records_it_creates_and_places(store):
    setup(store, catalog(model("m", cpu_profile()), model("g", gpu_profile())), node("a"))
    reconcile_once(store, FakeDispatcher(store), FakeClock().time, trace=TP)
    recs = {r.model: r for r in store.all_replicas()}
    assert recs["m"].traceparent == TP and recs["m"].node == "a"
    assert recs["g"].traceparent == TP and recs["g"].node is None  # Pending: no GPU node yet
    # a later pass places the pending one: its launch follows that pass
    store.write_heartbeat(node("b", "h100:1"), ttl=60)
    later = "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01"
    reconcile_once(store, FakeDispatcher(store), FakeClock().time, trace=later)
    placed = store.get_replica(recs["g"].id)
    assert placed.node == "b" and placed.traceparent == later
    assert store.get_replica(recs["m"].id).traceparent == TP  # untouched
    # an untraced pass writes none
    setup(store, catalog(model("m", cpu_profile(replicas=2))), node("a"))
    reconcile_once(store, FakeDispatcher(store), FakeClock().time)
    assert sorted(r.traceparent or "-" for r in store.all_replicas() if r.model == "m") == ["-", TP]


def test_a_launch_is_the_child_of_its_records_pass_and_the_engines_parent(traced):
    t, exporter = traced
    rec = ReplicaRecord(id="r1", model="m", profile="cpu", node="a", traceparent=TP)
    spec = LaunchSpec(argv=("engine",), env={"HF_HUB_OFFLINE": "1"})
    span, out = launch_span(t, rec, 2, "a", spec)
    span.end()
    (s,) = exporter.get_finished_spans()
    assert s.name == "llmgw.launch" and s.kind == SpanKind.CONSUMER
    assert f"{s.parent.trace_id:032x}-{s.parent.span_id:016x}" == TP[3:52] and s.parent.is_remote
    assert dict(s.attributes) == {"llmgw.replica": "r1", "llmgw.model": "m", "llmgw.profile": "cpu",
                                  "llmgw.node": "a", "llmgw.attempt": 2}
    assert out.env == {"HF_HUB_OFFLINE": "1",
                       "TRACEPARENT": f"00-{s.context.trace_id:032x}-{s.context.span_id:016x}-01"}
    assert spec.env == {"HF_HUB_OFFLINE": "1"}  # the engine driver's spec is not changed in place


def test_tracing_off_a_launch_changes_nothing():
    rec = ReplicaRecord(id="r1", model="m", profile="cpu", node="a", traceparent=TP)
    spec = LaunchSpec(argv=("engine",))
    span, out = launch_span(OFF, rec, 0, "a", spec)
    assert span is NO_SPAN and out is spec


def test_an_engines_start_is_recorded_under_its_launch_or_else_its_records_pass(traced):
    t, exporter = traced
    rec = ReplicaRecord(id="r1", model="m", profile="cpu", node="a", traceparent=TP, started_at=100.0, attempt=1,
                        url="http://127.0.0.1:9000")
    launched = "00-4bf92f3577b34da6a3ce929d0e0e4736-2222222222222222-01"
    launch = Launch(LaunchSpec(argv=("e",), env={"TRACEPARENT": launched, "LLMGW_ENGINE_SECRET": "s"}), "sim", None)
    ready_span(t, rec, 104.5, "a", launch)
    ready_span(t, rec, 104.5, "a", None)  # adopted: this agent did not launch it
    under_launch, under_pass = exporter.get_finished_spans()
    assert under_launch.name == "llmgw.engine_start" and f"{under_launch.parent.span_id:016x}" == "2222222222222222"
    assert f"{under_pass.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert (under_launch.start_time, under_launch.end_time) == (100_000_000_000, 104_500_000_000)
    assert under_launch.attributes["llmgw.url"] == "http://127.0.0.1:9000"
    assert "s" not in under_launch.attributes.values()
    # untraced records, or no times: nothing
    assert ready_span(t, ReplicaRecord(id="r2", model="m", profile="cpu", started_at=1.0), 2.0, "a", None) is NO_SPAN
    assert ready_span(t, rec, None, "a", launch) is NO_SPAN
    assert len(exporter.get_finished_spans()) == 2
