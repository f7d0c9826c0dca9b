"""The reconcile pass's adapter phase (workers/control/adapterplan.py, reconcile.py) and what the publisher
lists (workers/control/adapters.published_adapters): new replicas are created with their adapters, a
runtime replica's `adapters_wanted` is written only when it changes, llama.cpp replicas are replaced
(never changed in place) and only for an adapter's floor, replicas on their way out are left alone,
failed loads wait for their backoff, demand comes from the gateways' reports under the adapter's name."""

from __future__ import annotations

from dataclasses import replace

import fakeredis

from llmgw.catalog import Catalog, parse_catalog_text, profile_spec_hash
from llmgw.state.demand_records import DemandHint, GatewayReport, ModelDemand
from llmgw.state.node_records import NodeInfo
from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store
from workers.control.adapterplan import AdapterRow, adapter_demand, decide_adapters
from workers.control.adapterplacement import published_adapters
from workers.control.apply import ReconcilePass, apply_reconcile
from workers.control.placement import Placement
from workers.control.plan import CreateReplica, StopReplica
from workers.control.reconcile import decide, demand_reads
from workers.control.snapshot import Snapshot

NOW = 1000.0


def cat(engine: str = "sim", replicas: int = 2, max_loras: int = 2, adapters: str = "") -> Catalog:
    """A model `base` with one profile `p` of `engine` serving adapters (a1, a2, a3 by default)."""
    ext = ".gguf" if engine == "llamacpp" else ""
    ads = adapters or ", ".join(f"{{name: a{i}, source: /ad/a{i}, rank: 8}}" for i in (1, 2, 3))
    return parse_catalog_text(f"""
models:
  - name: base
    source: /m/base{ext}
    profiles:
      - {{name: p, engine: {engine}, replicas: {replicas}, lora: {{max_loras: {max_loras}}}}}
    adapters: [{ads.replace(", rank", f"{ext}, rank")}]
""")


def rec(c, rid: str, ready: bool = True, node: str = "n1", **kw) -> ReplicaRecord:
    m = c.model("base")
    fields = dict(id=rid, model="base", profile="p", spec_hash=profile_spec_hash(m, m.profiles[0]), node=node,
                  created_at=1.0, launch_dispatched_at=1.0, attempt=1, started_at=2.0, url=f"http://{rid}", pid=10)
    if ready:
        fields.update(first_ready_at=3.0, last_probe_ok=True, last_probe_at=NOW - 0.1)
    fields.update(kw)
    return ReplicaRecord(**fields)


def snap(*recs: ReplicaRecord, nodes=("n1", "n2")) -> Snapshot:
    return Snapshot(nodes={n: NodeInfo(name=n) for n in nodes}, replicas=tuple(recs))


def create(rid: str, node: str = "n1") -> CreateReplica:
    return CreateReplica(rid, "base", "p", "h", Placement(nodes=(node,), gpus=()))


def test_new_replicas_are_created_with_their_adapters():
    c = cat()
    acts = [create("r1"), create("r2", "n2")]
    d = decide_adapters(c, snap(), acts, {}, NOW)
    out = d.with_adapters(acts)
    held = [set(a.adapters) for a in out]
    assert set().union(*held) == {"a1", "a2", "a3"} and all(len(h) <= 2 for h in held)
    assert out[0].record(NOW).adapters_wanted == list(out[0].adapters)
    assert d.wanted == {} and d.relaunch == {}
    assert [(r.adapter, r.placed, r.short) for r in d.rows] == [("a1", 1, False), ("a2", 1, False), ("a3", 1, False)]


def test_a_runtime_replicas_set_is_written_only_when_it_changes():
    c = cat()
    r1 = rec(c, "r1", adapters_wanted=["a1", "a3"], adapters_held=["a1", "a3"], adapters_attempt=1)
    r2 = rec(c, "r2", node="n2", adapters_wanted=["a2"], adapters_held=["a2"], adapters_attempt=1)
    assert decide_adapters(c, snap(r1, r2), [], {}, NOW).wanted == {}
    # A restarted engine (attempt 2) holds nothing yet: it keeps what it was told, no reshuffle.
    r1b = rec(c, "r1", attempt=2, started_at=5.0, first_ready_at=6.0, adapters_wanted=["a1", "a3"],
              adapters_held=["a1", "a3"], adapters_attempt=1)
    assert decide_adapters(c, snap(r1b, r2), [], {}, NOW).wanted == {}
    # r1 goes: its adapters move to r2 (which has room for one more), written once, its agent woken.
    d = decide_adapters(c, snap(r1, r2), [StopReplica("r1", "scale down")], {}, NOW)
    assert d.wanted == {"r2": ("a1", "a2")} and d.nodes == {"r2": "n2"}
    assert [r.adapter for r in d.rows if r.short] == ["a3"]


def test_a_failed_load_waits_for_its_backoff_and_goes_elsewhere_meanwhile():
    c = cat(replicas=2, max_loras=2, adapters="{name: a1, source: /ad/a1, rank: 8}")
    failed = {"a1": {"reason": "vLLM found no adapter", "at": NOW - 1, "attempts": 1}}
    r1 = rec(c, "r1", adapters_wanted=["a1"], adapter_failures=failed, adapters_attempt=1)
    r2 = rec(c, "r2", node="n2")
    d = decide_adapters(c, snap(r1, r2), [], {}, NOW)
    assert d.wanted == {"r1": (), "r2": ("a1",)}
    # Only r1 serves it: a shortfall that says why and when it is tried again.
    d = decide_adapters(c, snap(r1), [], {}, NOW)
    (row,) = d.rows
    assert row.short and "loading it failed on r1 (1x): vLLM found no adapter; next try at" in row.reason
    assert d.wanted == {"r1": ()}
    # After the backoff, r1 is told to hold it again (its agent retries).
    d = decide_adapters(c, snap(r1), [], {}, NOW + 10)
    assert d.wanted == {} and not d.rows[0].short


def test_replicas_on_their_way_out_are_left_alone():
    c = cat()
    stopping = rec(c, "r1", adapters_wanted=["a1"], adapters_held=["a1"], adapters_attempt=1, stop_requested_at=NOW)
    rolled = rec(c, "r2", spec_hash="old", adapters_wanted=["a2"], adapters_held=["a2"], adapters_attempt=1)
    lost = rec(c, "r3", node="gone", adapters_wanted=["a3"], adapters_held=["a3"], adapters_attempt=1)
    fresh = rec(c, "r4", node="n2")
    d = decide_adapters(c, snap(stopping, rolled, lost, fresh), [], {}, NOW)
    assert set(d.wanted) == {"r4"} and len(d.wanted["r4"]) == 2


def test_llamacpp_replicas_are_replaced_for_a_floor_never_for_demand():
    c = cat(engine="llamacpp", replicas=2, max_loras=1,
            adapters="{name: a1, source: /ad/a1, rank: 8}, {name: a2, source: /ad/a2, rank: 8, replicas: 0}")
    r1 = rec(c, "r1", adapters_wanted=["a1"], adapters_held=["a1"], adapters_attempt=1)
    r2 = rec(c, "r2", node="n2")
    # a1 is busy: still one replica (a second would be a replacement); nothing is written in place.
    d = decide_adapters(c, snap(r1, r2), [], {"a1": 50.0}, NOW)
    assert d.wanted == {} and d.relaunch == {}
    # a2 (replicas: 0) is requested: its floor is one, so r2 is replaced by one launched with it.
    d = decide_adapters(c, snap(r1, r2), [], {"a2": 1.0}, NOW)
    assert d.relaunch == {"r2": ("a2",)} and d.wanted == {}
    # The replacement the plan then creates gets a2; the marked r2 is not placed on any more.
    marked = rec(c, "r2", node="n2", adapters_relaunch=["a2"])
    acts = [create("r5", "n2")]
    d = decide_adapters(c, snap(r1, marked), acts, {"a2": 1.0}, NOW)
    assert d.created == {"r5": ("a2",)} and d.relaunch == {}


def test_published_adapters_are_held_this_attempt_and_still_wanted():
    c = cat()
    m = c.model("base")
    p = m.profiles[0]
    r = rec(c, "r1", adapters_wanted=["a1"], adapters_held=["a1", "a2"], adapters_attempt=1)
    assert published_adapters(r, m, p) == ("a1",)  # a2 is about to be unloaded: no new requests
    assert published_adapters(rec(c, "r1", attempt=2, adapters_held=["a1"], adapters_attempt=1), m, p) == ()
    cl = cat(engine="llamacpp")
    ml = cl.model("base")
    r = rec(cl, "r1", adapters_wanted=["a2", "a1"], adapters_held=["a2", "a1"], adapters_attempt=1)
    assert published_adapters(r, ml, ml.profiles[0]) == ("a2", "a1")  # every one, in id order


def test_demand_is_counted_by_adapter_name():
    reports = [GatewayReport(id="g1", at=NOW, models={"a1": ModelDemand(2, 1, NOW), "base": ModelDemand(5, 0, NOW),
                                                      "a2": ModelDemand(0, 0, NOW - 10)}),
               GatewayReport(id="g2", at=NOW, models={"a1": ModelDemand(1, 0, NOW), "a3": ModelDemand(0, 0, NOW - 999)})]
    d = adapter_demand(reports, {"a3": object()}, ["a1", "a2", "a3"], NOW)
    assert d == {"a1": 4.02, "a2": 0.01, "a3": 1.0}


class _Dispatch:
    def __init__(self):
        self.sent: list[tuple[str, str]] = []

    def launch(self, replica_id: str, node: str) -> None:
        self.sent.append(("launch", replica_id))

    def stop(self, replica_id: str, node: str) -> None:
        self.sent.append(("stop", replica_id))


def _pass(store: Store, c: Catalog, s: Snapshot, now: float):
    """One reconcile pass over `s` with the demand and rows read from `store`: decide, apply."""
    s = replace(s, demand=store.fleet_view(demand_reads(c, now)).demand)
    d = decide(c, s, now)
    result = apply_reconcile(d, ReconcilePass(store, _Dispatch(), lambda: now, 0.0), now)
    assert result.failed == 0
    return d


def test_the_pass_writes_rows_events_and_marks_through_the_store():
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    c = cat(replicas=1, max_loras=1,
            adapters="{name: a1, source: /ad/a1, rank: 8}, {name: a2, source: /ad/a2, rank: 8, replicas: 0}")
    r1 = rec(c, "r1")
    store.create_replica(r1)
    store.write_demand_hint("a2", DemandHint(NOW, 3), 10)  # a gateway holds requests for a2
    d = _pass(store, c, snap(r1), NOW)
    assert d.actions == () and d.kicks_publish  # a2 is put on r1
    assert store.get_replica("r1").adapters_wanted == ["a2"]  # the requested one takes the only slot
    _at, rows = store.adapter_rows()
    assert [(x["adapter"], AdapterRow.from_dict(x).short) for x in rows] == [("a1", True), ("a2", False)]
    assert [e.kind for e in store.read_events()] == ["adapter_short"]
    _pass(store, c, snap(r1), NOW + 1)  # the same shortfall again: no second event
    assert [e.kind for e in store.read_events()] == ["adapter_short"]
    d = _pass(store, parse_catalog_text("models: []"), snap(r1), NOW)
    assert d.adapters.decision is None and d.adapters.rows == ()  # the rows go with the last adapter
    assert store.adapter_rows() == (None, [])
    assert _pass(store, parse_catalog_text("models: []"), snap(r1), NOW).adapters.rows is None  # and stay gone


def test_replicas_unload_the_last_adapter_removed_from_the_catalog():
    # Found on real vLLM (tests/e2e/test_vllm_cpu.py): with no adapter left in the model, its
    # replicas were skipped and kept being told to hold the removed one.
    c = cat(adapters="{name: a1, source: /ad/a1, rank: 8}")
    r1 = rec(c, "r1", adapters_wanted=["a1"], adapters_held=["a1"], adapters_attempt=1)
    r2 = rec(c, "r2", node="n2")
    gone = parse_catalog_text("""
models:
  - name: base
    source: /m/base
    profiles:
      - {name: p, engine: sim, replicas: 2, lora: {max_loras: 2}}
""")
    d = decide_adapters(gone, snap(r1, r2), [], {}, NOW)
    assert d.wanted == {"r1": ()} and d.nodes == {"r1": "n1"}
    assert decide_adapters(gone, snap(rec(c, "r1"), r2), [], {}, NOW).wanted == {}
    # Through the whole pass and the store (it skipped a catalog without any adapter).
    store = Store(fakeredis.FakeRedis(decode_responses=True))
    store.create_replica(r1)
    _pass(store, gone, snap(r1, r2), NOW)
    assert store.get_replica("r1").adapters_wanted == []
    assert _pass(store, gone, snap(store.get_replica("r1"), r2), NOW).adapters.decision is None
