"""Property tests of the whole reconcile pass (`workers.control.reconcile.decide`: autoscaling, plan,
LoRA adapters) over many passes with changing demand: a pass applied to its snapshot leaves nothing
to decide at the same moment, unless it asked to look again at once (a replica it marked to
relaunch with another adapter set), and then the pass that follows settles it."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llmgw.errors import CatalogInvalid
from llmgw.state.demand_records import DemandHint, EndpointUse, GatewayReport, ModelDemand
from llmgw.state.records import LoadRecord
from tests.unit.control_support import PassSim, catalog, node
from workers.control.reconcile import Reconcile


@st.composite
def profile(draw, i: int) -> dict:
    engine = draw(st.sampled_from(["sim", "llamacpp", "vllm"]))
    ext = ".gguf" if engine == "llamacpp" else ""
    prof: dict = {"name": "p", "engine": engine, "capacity": draw(st.integers(1, 8))}
    if engine == "vllm":
        prof.update(gpu={"class": "h100", "count": 1}, tensor_parallel=1)
    if draw(st.booleans()):
        lo = draw(st.integers(0, 2))
        prof["autoscale"] = {"min": lo, "max": draw(st.integers(max(lo, 1), 4)),
                             "scale_up_after": draw(st.sampled_from([1, 2, 4])),
                             "scale_down_after": draw(st.sampled_from([2, 6, 10])),
                             "target": draw(st.sampled_from([0.5, 0.7, 1.0]))}
        if lo == 0:
            prof["autoscale"]["idle_after"] = draw(st.sampled_from([4, 10]))
    else:
        prof["replicas"] = draw(st.integers(0, 3))
    model = {"name": f"m{i}", "source": f"/m/m{i}{ext}", "profiles": [prof]}
    n_adapters = draw(st.integers(0, 3))
    if n_adapters:
        prof["lora"] = {"max_loras": draw(st.integers(1, 2))}
        model["adapters"] = [
            {"name": f"m{i}-a{j}", "source": f"/ad/m{i}a{j}{ext}", "rank": 8,
             **({} if (r := draw(st.sampled_from([None, 0, 0, 1, 2]))) is None else {"replicas": r})}
            for j in range(n_adapters)]
    return model


@st.composite
def scenario(draw):
    n = draw(st.integers(1, 4))
    nodes = {f"n{i}": node(f"n{i}", draw(st.sampled_from(["", "h100:1", "h100:2"]))) for i in range(n)}
    models = [draw(profile(i)) for i in range(draw(st.integers(1, 3)))]
    return nodes, models, draw(st.integers(4, 12)), draw(st.randoms(use_true_random=False))


def names(models: list[dict]) -> list[str]:
    return [m["name"] for m in models] + [a["name"] for m in models for a in m.get("adapters", [])]


def demand(sim: PassSim, models: list[dict], rnd) -> None:
    """What the gateways, their cold-start hints and the engines' scrapes say now: anything."""
    live = [r for r in sim.records.values() if r.stop_requested_at is None]
    wanted = names(models)
    sim.gateways = [
        GatewayReport(id=f"g{g}", at=sim.now,
                      endpoints={r.id: EndpointUse(rnd.randint(0, 12), sim.now) for r in live if rnd.random() < 0.6},
                      models={x: ModelDemand(rnd.randint(0, 4), rnd.randint(0, 3), sim.now - rnd.choice([0, 400]))
                              for x in wanted if rnd.random() < 0.4})
        for g in range(rnd.randint(0, 2))]
    sim.hints = {x: DemandHint(sim.now, rnd.randint(1, 3)) for x in wanted if rnd.random() < 0.2}
    sim.loads = {r.id: LoadRecord(r.id, sim.now, True, running=float(rnd.randint(0, 8)),
                                  waiting=float(rnd.randint(0, 4))) for r in live if rnd.random() < 0.5}


def what(d: Reconcile) -> str:
    a = d.adapters.decision
    changed = [p.decision.reason for p in d.scaling.scale.profiles if p.decision.changed]
    return (f"actions {list(d.actions)}; changed {changed}; forget {d.scaling.forget}; "
            f"adapters {a and (dict(a.wanted), dict(a.relaunch))}; events {list(d.events)}")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenario())
def test_a_pass_applied_leaves_nothing_to_decide(sc):
    nodes, models, steps, rnd = sc
    try:
        cat = catalog(*models)
    except CatalogInvalid:  # more adapter slots wanted than the profiles give, and the like
        assume(False)
    sim = PassSim(cat, nodes)
    for _ in range(steps):
        demand(sim, models, rnd)
        d = sim.reconcile_pass()
        for _ in range(3):  # a pass that asked to look again at once gets that pass
            if not d.requeue:
                break
            d = sim.reconcile_pass()
        assert not d.requeue, what(d)
        again = sim.decide()
        assert again.settled, what(again)
        if rnd.random() < 0.8:
            sim.agents()
        if len(sim.nodes) > 1 and rnd.random() < 0.1:
            sim.lose(rnd.choice(sorted(sim.nodes)))
        sim.tick(rnd.choice([1, 2, 5]))
    # The pass decided what the catalog asks: every autoscaled profile has a record, no other does.
    auto = {(m["name"], "p") for m in models if "autoscale" in m["profiles"][0]}
    assert set(sim.scale_states) == auto


def test_a_scale_up_is_one_decision_and_the_next_pass_holds():
    """The counterpart of the property by hand: a cold start decides a count and an event once."""
    models = [{"name": "m", "profiles": [{"name": "p", "engine": "sim", "capacity": 1,
                                          "autoscale": {"min": 0, "max": 3}}]}]
    sim = PassSim(catalog(*models), {"a": node("a")})
    sim.hints = {"m": DemandHint(sim.now, 2)}
    d = sim.reconcile_pass()
    assert [e.kind for e in d.events] == ["replica_scaled", "model_cold_start"]
    assert len(d.actions) == 3 and not d.settled  # 2 requests at target 0.7 on capacity 1: 3 replicas
    again = sim.decide()
    assert again.settled and again.scaling.scale.profiles[0].decision.reason.startswith("holds 3")
