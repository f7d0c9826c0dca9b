"""Property tests of the reconciler over many passes: whatever the fleet, the spec changes and the
drains, a model that had a Ready replica never drops to zero Ready while the change rolls out, and
the fleet converges to the catalog when capacity allows."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.state.node_records import NodeAdmin
from tests.unit.control_support import Sim, catalog, node


@st.composite
def scenario(draw):
    n = draw(st.integers(2, 5))
    nodes = {f"n{i}": node(f"n{i}", draw(st.sampled_from(["", "h100:1", "h100:2", "h100:4"]))) for i in range(n)}
    models = []
    for i in range(draw(st.integers(1, 3))):
        prof = {"name": "p", "replicas": draw(st.integers(1, 3))}
        if draw(st.booleans()):
            prof.update(engine="vllm", gpu={"class": "h100", "count": 1}, tensor_parallel=1)
        else:
            prof.update(engine="sim")
        models.append({"name": f"m{i}", "profiles": [prof]})
    changes = draw(st.lists(st.sampled_from(["spec", "drain", "uncordon", "scale"]), min_size=1, max_size=3))
    ready_after = draw(st.sampled_from([0.0, 2.0, 5.0]))
    return nodes, models, changes, ready_after, draw(st.randoms(use_true_random=False))


def step(sim: Sim, ready_after: float) -> None:
    sim.reconcile()
    sim.agents(ready=False)
    for rid, rec in sim.records.items():
        if rec.running and rec.first_ready_at is None and sim.now - rec.started_at >= ready_after:
            sim.update(rid, first_ready_at=sim.now, last_probe_ok=True, last_probe_at=sim.now)
    sim.tick(2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_changes_never_take_a_ready_model_to_zero(sc):
    nodes, models, changes, ready_after, rnd = sc
    sim = Sim(catalog(*models), nodes)
    for _ in range(8):
        step(sim, ready_after)
    for change in changes:
        had_ready = {m["name"] for m in models if sim.ready(m["name"])}
        if change == "spec":
            m = rnd.choice(models)
            env = m["profiles"][0].setdefault("env", {})
            env["GENERATION"] = str(int(env.get("GENERATION", "0")) + 1)  # any spec field would do
            sim.cat = catalog(*models)
        elif change == "drain":
            sim.admin[rnd.choice(sorted(nodes))] = NodeAdmin(cordoned=True, draining=True)
        elif change == "uncordon":
            sim.admin.clear()
        else:
            m = rnd.choice(models)
            m["profiles"][0]["replicas"] = max(1, m["profiles"][0]["replicas"] + rnd.choice([-1, 1]))
            sim.cat = catalog(*models)
        for _ in range(15):
            step(sim, ready_after)
            for name in had_ready:
                assert sim.ready(name), f"{name} dropped to zero Ready after {change}"
    # Converged where capacity allowed: no replica of an old spec or on a draining node is Ready
    # while its replacement could have been placed.
    sim.admin.clear()
    for _ in range(20):
        step(sim, ready_after)
    for m in models:
        want = m["profiles"][0]["replicas"]
        got = len(sim.ready(m["name"]))
        pending = [r for r in sim.records.values() if r.model == m["name"] and r.node is None]
        assert got == want or pending, (m["name"], got, want)
