"""bench/oracle.py: greedy routers that know each engine's exact state. What they predict for an
engine must be what the engine then does, and predicting must not change the engine."""

from __future__ import annotations

from types import SimpleNamespace

from bench.oracle import NEW, ahead, oracle_own, oracle_total
from llmgw.state.records import EndpointInfo
from simengine.core import SimConfig, SimCore
from simengine.prefix import PrefixCache

CFG = SimConfig(max_seqs=2, kv_tokens=4096, step_ms=20.0, batch_alpha=0.1, prefill_ms_per_token=0.5)


def request(prompt: list[int], answer: int) -> SimpleNamespace:
    return SimpleNamespace(prompt=len(prompt), output=answer, tokens=tuple(prompt), out_tokens=tuple(range(answer)))


def engine() -> SimpleNamespace:
    return SimpleNamespace(core=SimCore(CFG, prefix=PrefixCache()), step=None)


def run_for_real(e: SimpleNamespace, now: float) -> dict[str, float]:
    """Step the engine's own model until it is idle: when each request completes."""
    done, step = {}, e.core.plan_step(now)
    end = now + step.duration
    while step is not None:
        for ev in e.core.finish_step(step, end):
            if ev.done:
                done[ev.rid] = end
        step = e.core.plan_step(end)
        if step is not None:
            end += step.duration
    return done


def test_the_prediction_is_what_the_engine_then_does_and_leaves_it_as_it_was():
    e = engine()
    for i in range(3):  # two running, one waiting for a slot
        r = request(list(range(100 * i, 100 * i + 200)), 10 + i)
        e.core.submit(f"r{i}", r.prompt, r.output, 0.0, tokens=list(r.tokens), output=list(r.out_tokens))
    step = e.core.plan_step(0.0)
    e.step = (step, step.duration)  # a step in progress, as bench/fleetsim.py's engines keep it
    new = request(list(range(5000, 5300)), 8)

    def state():
        c = e.core
        return ([(s.rid, s.generated, s.prefilled, tuple(s.hashes)) for s in list(c.running.values()) + list(c.waiting)],
                {h: b.refs for h, b in c.prefix.blocks.items()}, list(c.prefix.free), c.prefix.queries,
                c.generation_tokens_total)

    before = state()
    _, predicted = ahead(e, 0.001, new, everyone=True)
    assert state() == before  # predicting changed nothing of the engine
    # now for real: the step in progress ends, then the request sent at 0.001 joins
    e.core.finish_step(step, step.duration)
    e.core.submit(NEW, new.prompt, new.output, 0.001, tokens=list(new.tokens), output=list(new.out_tokens))
    real = run_for_real(e, step.duration)
    assert predicted == real


def test_both_oracles_send_a_prompt_where_the_engine_holds_it_when_all_else_is_equal():
    cold, warm = engine(), engine()
    prompt = list(range(1000))
    warm.core.submit("before", len(prompt), 1, 0.0, tokens=prompt, output=[7])
    run_for_real(warm, 0.0)  # its blocks stay in the cache, unreferenced
    eps = [EndpointInfo(id=i, url=f"sim://{i}", models=("m",), engine="sim") for i in ("cold", "warm")]
    gateway = SimpleNamespace(sim=SimpleNamespace(now=10.0, engines={"cold": cold, "warm": warm}),
                              router=SimpleNamespace(endpoints=eps))
    turn = request(prompt + [1, 2, 3], 16)
    assert oracle_own(gateway, turn).id == "warm"
    assert oracle_total(gateway, turn).id == "warm"
    # ... and away from it when the engine holding it is busy enough that the miss elsewhere is quicker
    for i in range(6):
        r = request(list(range(9000 + 500 * i, 9000 + 500 * i + 400)), 200)
        warm.core.submit(f"busy{i}", r.prompt, r.output, 10.0, tokens=list(r.tokens), output=list(r.out_tokens))
    assert oracle_own(gateway, turn).id == "cold"


def test_the_command_line_prints_each_router_beside_the_smg_model_and_refuses_what_it_cannot_run(capsys):
    import pytest

    from bench.oracle import main

    assert main(["--seeds", "1", "--first-seed", "4", "--policies", "llmgw,smg_cache_aware"]) == 0
    out = capsys.readouterr().out
    assert "seeds 4-4 pooled" in out and "against the smg model" in out
    tail, against = out.split("the slowest 1 %")[1].split("against the smg model")
    assert [line.split()[0] for line in tail.splitlines() if line.startswith("    ")] == ["llmgw", "smg_cache_aware"]
    assert [line.split()[0] for line in against.splitlines() if line.startswith("    ")] == ["llmgw"]
    for bad in (["--seeds", "0"], ["--policies", "nginx"], ["--fleets", "fleet-a"]):
        with pytest.raises(SystemExit):
            main(bad)
        assert "error:" in capsys.readouterr().err
