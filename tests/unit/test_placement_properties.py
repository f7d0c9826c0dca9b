"""Property tests of placement through the planner: random fleets and catalogs, invariants that must
hold whatever the input."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.catalog import profile_spec_hash
from llmgw.state.node_records import NodeAdmin
from tests.unit.control_support import Sim, catalog, node
from workers.control.plan import CreateReplica

CLASSES = ("h100", "l4")
POOLS = ("default", "gpu")
ZONES = ("x", "y")


@st.composite
def fleets(draw):
    n = draw(st.integers(1, 8))
    nodes, admin = {}, {}
    for i in range(n):
        parts = []
        for cls in CLASSES:
            k = draw(st.integers(0, 8))
            if k:
                parts.append(f"{cls}:{k}")
        name = f"n{i}"
        nodes[name] = node(name, ",".join(parts), pool=draw(st.sampled_from(POOLS)),
                           labels={"zone": draw(st.sampled_from(ZONES))})
        if draw(st.integers(0, 5)) == 0:
            admin[name] = NodeAdmin(cordoned=True, draining=draw(st.booleans()))
    return nodes, admin


@st.composite
def catalogs(draw):
    models = []
    for i in range(draw(st.integers(1, 5))):
        prof = {"name": "p", "replicas": draw(st.integers(0, 12)), "pool": draw(st.sampled_from(POOLS)),
                "priority": draw(st.integers(0, 2))}
        if draw(st.booleans()):
            prof["node_selector"] = {"zone": draw(st.sampled_from(ZONES))}
        if draw(st.booleans()):
            count = draw(st.sampled_from((1, 2, 4, 8)))
            nodes = draw(st.sampled_from((1, 1, 1, 2)))
            prof.update(engine="vllm", gpu={"class": draw(st.sampled_from(CLASSES)), "count": count},
                        tensor_parallel=count * nodes, nodes=nodes)
        else:
            prof.update(engine="sim")
        models.append({"name": f"m{i}", "profiles": [prof]})
    return catalog(*models)


def check_invariants(sim: Sim, placed_since: float = float("-inf")) -> None:
    """`placed_since`: records placed before it were placed under an older catalog (a pool or
    node_selector change leaves them outdated, not re-hashed, until their replacement is Ready)."""
    owners = sim.gpu_owners()
    doubled = {k: v for k, v in owners.items() if len(v) > 1}
    assert not doubled, f"GPUs allocated twice: {doubled}"
    for rid, rec in sim.records.items():
        if rec.node is None:
            assert rec.pending_reason, f"{rid} is Pending without a reason"
            continue
        model = sim.cat.model(rec.model)
        prof = model.profile(rec.profile) if model else None
        if (rec.stop_requested_at is not None or prof is None or any(n not in sim.nodes for n in rec.nodes)
                or rec.spec_hash != profile_spec_hash(model, prof)
                or (rec.launch_dispatched_at or 0) < placed_since):
            continue  # on its way out: placed under rules that no longer apply
        assert rec.node == rec.nodes[0]
        assert len(rec.nodes) == prof.nodes == len(set(rec.nodes))
        for n in rec.nodes:
            info = sim.nodes[n]
            assert info.pool == prof.pool, f"{rid} on {n} of pool {info.pool}, wants {prof.pool}"
            for k, v in prof.node_selector.items():
                assert info.labels.get(k) == v, f"{rid} on {n} whose labels do not match"
            if prof.gpu:
                idxs = rec.gpus[n]
                assert len(idxs) == prof.gpu.count
                classes = {g.index: g.gpu_class for g in info.gpus}
                assert all(classes.get(i) == prof.gpu.gpu_class for i in idxs), f"{rid} got wrong GPUs on {n}"
            else:
                assert not rec.gpus


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets(), cat=catalogs())
def test_one_pass_respects_every_invariant(fleet, cat):
    nodes, admin = fleet
    sim = Sim(cat, nodes, admin=dict(admin))
    actions = sim.reconcile()
    check_invariants(sim)
    for a in actions:
        if isinstance(a, CreateReplica) and a.placement:
            assert not any(admin.get(n) for n in a.placement.nodes), "placed on a cordoned/draining node"
    # CPU replicas of one model are spread evenly over its eligible nodes (differ by at most one).
    for m in cat.models:
        prof = m.profiles[0]
        if prof.gpu:
            continue
        eligible = [n for n, info in nodes.items() if info.pool == prof.pool and n not in admin
                    and all(info.labels.get(k) == v for k, v in prof.node_selector.items())]
        per_node = Counter(r.node for r in sim.records.values() if r.model == m.name and r.node)
        if eligible and prof.replicas:
            counts = [per_node.get(n, 0) for n in eligible]
            assert max(counts) - min(counts) <= 1, (m.name, dict(per_node), eligible)
            assert sum(counts) == prof.replicas


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets(), cat=catalogs(), cat2=catalogs(), lost=st.integers(0, 7))
def test_invariants_hold_across_passes_catalog_changes_and_a_lost_node(fleet, cat, cat2, lost):
    nodes, admin = fleet
    sim = Sim(cat, nodes, admin=dict(admin))
    sim.converge(3)
    check_invariants(sim)
    sim.cat = cat2
    changed = sim.now
    if f"n{lost}" in sim.nodes:
        sim.lose(f"n{lost}")
    for _ in range(6):
        sim.reconcile()
        check_invariants(sim, placed_since=changed)
        sim.agents()
        sim.tick()
