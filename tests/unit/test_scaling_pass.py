"""The autoscaling step of the reconcile pass on fakeredis with a fake clock: it reads the gateways'
reports and cold-start hints, keeps a short history per profile, records each decision where
`llmgw status` reads it, emits events, and the planner creates or stops replicas by its count."""

from __future__ import annotations

import json

import pytest

from llmgw.catalog import apply_catalog
from llmgw.state import events, keys
from llmgw.state.kicks import Kicker
from llmgw.state.demand_records import DemandHint, EndpointUse, GatewayReport, ModelDemand
from llmgw.state.store import Store
from tests.support.clock import FakeClock
from tests.unit.control_support import catalog, cpu_profile, model, node
from tests.unit.test_control_apply import FakeDispatcher
from workers.control.apply import reconcile_once
from workers.control.autoscale import HISTORY_SLACK


def auto(min_=0, max_=3, **kw) -> dict:
    p = cpu_profile("cpu", capacity=10, **kw)
    del p["replicas"]
    return {**p, "autoscale": {"min": min_, "max": max_, "scale_up_after": 2, "scale_down_after": 10,
                               "idle_after": 30} if min_ == 0 else {"min": min_, "max": max_, "scale_up_after": 2,
                                                                    "scale_down_after": 10}}


def setup(store, *profiles):
    apply_catalog(store, catalog(model("m", *profiles, aliases=["alias"])), source="t", applied_by="t", now=0)
    store.write_heartbeat(node("a"), ttl=3600)


def live(store):
    return [r for r in store.all_replicas() if r.stop_requested_at is None]


def gateway(store, clock, endpoints=None, queued=0, name="m"):
    report = GatewayReport(id="g:1", at=clock.t, endpoints=endpoints or {},
                           models={name: ModelDemand(0, queued, clock.t)} if queued else {})
    store.write_gateway_report(report, ttl=3600)


def test_a_cold_start_hint_places_a_replica_in_the_next_pass(store):
    setup(store, auto())
    clock = FakeClock()
    d = FakeDispatcher(store)
    reconcile_once(store, d, clock.time)
    assert live(store) == []  # a new min-0 profile starts idle
    store.write_demand_hint("m", DemandHint(at=clock.t, queued=1), ttl=10)
    clock.advance(0.5)
    reconcile_once(store, d, clock.time)
    assert len(live(store)) == 1 and d.sent[-1][0] == "launch"
    (state,) = store.scale_states().values()
    assert (state.count, state.previous, state.reason) == (1, 0, "0 -> 1: 1 request waiting (cold start)")
    kinds = [e.kind for e in store.latest_events()]
    assert "replica_scaled" in kinds and "model_cold_start" in kinds


def test_queued_requests_reported_under_an_alias_count_too(store):
    setup(store, auto())
    clock = FakeClock()
    gateway(store, clock, queued=3, name="alias")
    reconcile_once(store, FakeDispatcher(store), clock.time)
    assert len(live(store)) == 1


def test_load_scales_up_then_down_and_the_history_stays_short(store):
    setup(store, auto(min_=1, max_=3))
    clock = FakeClock()
    d = FakeDispatcher(store)
    reconcile_once(store, d, clock.time)
    (rid,) = [r.id for r in live(store)]
    for _ in range(3):  # 20 requests on one replica of capacity 10: load 2.0 for 2 s
        gateway(store, clock, {rid: EndpointUse(20)})
        clock.advance(1)
        reconcile_once(store, d, clock.time)
    assert len(live(store)) == 3
    state = store.scale_states()[("m", "cpu")]
    assert state.reason == "1 -> 3: load 2.00 per replica for 2 s, target 0.7"
    for _ in range(80):  # idle: one replica fewer every 10 s, the least loaded first, never below min 1
        gateway(store, clock, {rid: EndpointUse(1)})
        clock.advance(1)
        reconcile_once(store, d, clock.time)
    assert [r.id for r in live(store)] == [rid]
    horizon = 10 + HISTORY_SLACK
    samples = store.r.zrange(keys.autoscale_history("m", "cpu"), 0, -1, withscores=True)
    assert samples and min(t for _, t in samples) >= clock.t - horizon


def test_a_profile_that_stops_autoscaling_is_forgotten_and_keeps_its_replicas_count(store):
    setup(store, auto(min_=2))
    clock = FakeClock()
    reconcile_once(store, FakeDispatcher(store), clock.time)
    assert len(live(store)) == 2 and store.scale_states()
    apply_catalog(store, catalog(model("m", cpu_profile("cpu", replicas=2, capacity=10), aliases=["alias"])), source="t", applied_by="t", now=1)
    clock.advance(1)
    reconcile_once(store, FakeDispatcher(store), clock.time)
    assert store.scale_states() == {} and not store.r.exists(keys.autoscale_history("m", "cpu"))
    assert len(live(store)) == 2


def test_status_shows_wanted_min_max_and_the_last_decision(store, monkeypatch, capsys):
    from llmgw import cli

    monkeypatch.setattr("llmgw.cli.status.store", lambda *_: store)
    setup(store, auto(min_=0, max_=2))
    clock = FakeClock(t=100.0)
    store.write_demand_hint("m", DemandHint(at=clock.t, queued=2), ttl=10)
    reconcile_once(store, FakeDispatcher(store), clock.time)
    monkeypatch.setattr("llmgw.cli.status.time.time", lambda: 112.0)
    assert cli.main(["status", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["autoscale"]
    assert (row["model"], row["profile"], row["wanted"], row["min"], row["max"], row["replicas"]) == \
        ("m", "cpu", 1, 0, 2, 1)
    assert row["last_change"] == "0 -> 1: 2 requests waiting (cold start)" and row["changed_age"] == 12.0
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "AUTOSCALING" in out and "0 -> 1: 2 requests waiting (cold start)" in out and "12s ago" in out


def test_a_catalog_apply_moves_the_endpoint_list_version_so_gateways_learn_a_model_at_zero(store):
    from workers.control.publish_pass import publish_once

    setup(store, auto())
    first = publish_once(store, lambda: 1.0)
    assert first is not None and publish_once(store, lambda: 2.0) is None  # nothing changed
    apply_catalog(store, catalog(model("m", auto()), model("n", auto())), source="t", applied_by="t", now=3)
    assert publish_once(store, lambda: 4.0) == first + 1  # no endpoint changed, the catalog did


def test_a_pass_that_sees_load_above_target_asks_for_a_pass_when_the_window_ends(store):
    sent = []
    kicker = Kicker(store, lambda task, countdown: sent.append((task, round(countdown, 3))))
    setup(store, auto(min_=1, max_=3))
    clock = FakeClock()
    reconcile_once(store, FakeDispatcher(store), clock.time, kicker=kicker)
    (rid,) = [r.id for r in live(store)]
    gateway(store, clock, {rid: EndpointUse(20)})
    clock.advance(0.5)
    sent.clear()
    reconcile_once(store, FakeDispatcher(store), clock.time, kicker=kicker)
    assert ("llmgw.reconcile", 2.0) in sent  # scale_up_after 2 s from this first sample above target


def test_the_pass_reads_its_demand_in_its_one_fleet_view(store, monkeypatch):
    """Autoscaling and the LoRA adapters decide on what the pass's one `fleet_view` read: the
    gateways' reports, hints, loads, the autoscaler's records and the adapter rows are not read
    again (a second read could see other facts than the plan did)."""
    m = model("m", {**auto(), "lora": {"max_loras": 1}})
    m.update(source="/m/m", adapters=[{"name": "a1", "source": "/ad/a1", "rank": 8}])
    apply_catalog(store, catalog(m), source="t", applied_by="t", now=0)
    store.write_heartbeat(node("a"), ttl=3600)
    clock = FakeClock()
    gateway(store, clock, queued=2)
    store.write_demand_hint("a1", DemandHint(at=clock.t, queued=1), ttl=10)

    def refuse(name):
        return lambda *a, **kw: pytest.fail(f"the pass read {name} outside its fleet_view")

    for name in ("gateway_reports", "scale_states", "loads", "adapter_rows"):
        monkeypatch.setattr(Store, name, refuse(name))
    views = []
    fleet_view = Store.fleet_view
    monkeypatch.setattr(Store, "fleet_view", lambda self, *a: views.append(a) or fleet_view(self, *a))
    reconcile_once(store, FakeDispatcher(store), clock.time)
    assert len(views) == 1
    (rec,) = live(store)
    assert rec.adapters_wanted == ["a1"]  # created with the adapter its hint asked for
    monkeypatch.undo()
    assert store.scale_states()[("m", "cpu")].count == 1 and store.adapter_rows().rows[0]["adapter"] == "a1"
