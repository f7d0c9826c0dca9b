"""Engine credentials: each replica's secret reaches its engine's environment (never its argv), the
agent's scrape and the published endpoint; rotating rolls the replicas; profiles cannot override it."""

import fakeredis
import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import LaunchContext
from llmgw.engines.llamacpp import LlamaCppDriver
from llmgw.engines.vllm import VllmDriver
from llmgw.state.replica_state import State
from llmgw.state.store import Store
from tests.unit.control_support import Sim, catalog, cpu_profile, gpu_profile, model, node, ready_record
from workers.agent.scrape import scrape_targets
from workers.control.plan import CreateReplica, StopReplica
from tests.unit.test_gateway_app import server, store  # noqa: F401 - fixtures
from workers.control.publish import endpoints_from

SECRET = "s3cret-value"


def llama() -> LlamaCppDriver:
    return LlamaCppDriver(environ={"LLMGW_LLAMA_SERVER": "/bin/ls"}, exists=lambda p: True)


def ctx(engine: str, **kw) -> LaunchContext:
    p = Profile(name="p", engine=engine, **({"gpu": {"class": "h100"}} if engine == "vllm" else {}))
    m = Model(name="m", source="/m.gguf" if engine == "llamacpp" else "", profiles=[p])
    return LaunchContext(replica_id="r1", model=m, profile=p, host="127.0.0.1", port=9000, **kw)


@pytest.mark.parametrize("driver, variable", [(get_engine("sim"), "SIMENGINE_API_KEY"),
                                               (VllmDriver(environ={}), "VLLM_API_KEY"),
                                               (llama(), "LLAMA_API_KEY")])
def test_the_secret_goes_to_the_engine_by_its_environment_only(driver, variable):
    spec = driver.command(ctx(driver.name, api_key=SECRET))
    assert spec.env[variable] == SECRET
    assert not any(SECRET in a for a in spec.argv)  # argv is world-readable and the shim logs it
    assert SECRET not in repr(ctx(driver.name, api_key=SECRET))
    assert variable not in driver.command(ctx(driver.name)).env  # a record made before credentials


def test_multi_node_members_get_no_secret():
    p = Profile(name="p", engine="sim", nodes=2, gpu={"class": "h100"})
    m = Model(name="m", profiles=[p])
    member = LaunchContext(replica_id="r", model=m, profile=p, host="h", port=1, node_rank=1, nnodes=2,
                           master_addr="10.0.0.1", master_port=29500, api_key=None)
    assert "SIMENGINE_API_KEY" not in get_engine("sim").command(member).env


@pytest.mark.parametrize("engine, args, env, path", [
    ("sim", ["--api-key", "x"], {}, "args"),
    ("sim", ["--api-key=x"], {}, "args"),
    ("sim", [], {"SIMENGINE_API_KEY": "x"}, "env.SIMENGINE_API_KEY"),
    ("vllm", ["--api-key", "x"], {}, "args"),
    ("vllm", [], {"VLLM_API_KEY": "x"}, "env.VLLM_API_KEY"),
    ("llamacpp", ["--api-key-file", "/k"], {}, "args"),
    ("llamacpp", [], {"LLAMA_API_KEY": "x"}, "env.LLAMA_API_KEY"),
])
def test_a_profile_cannot_set_the_engine_credential(engine, args, env, path):
    kw = {"gpu": {"class": "h100"}} if engine == "vllm" else {}
    problems = get_engine(engine).refusals(Profile(name="p", engine=engine, args=args, env=env, **kw))
    assert [p.path for p in problems] == [path] and "set by llmgw" in problems[0].reason


def test_the_secret_is_published_and_scraped_with_but_never_shown():
    rec = ready_record("r1", "m", "cpu", "b", 1000.0, engine_secret=SECRET)
    [ep] = endpoints_from(catalog(model("m", cpu_profile())), [rec], {"b": node("b")}, 1000.0)
    assert ep.engine_secret == SECRET and SECRET not in repr(ep) and SECRET not in repr(rec)
    [target] = scrape_targets([rec], {"r1": None})
    assert target.secret == SECRET and SECRET not in repr(target)
    legacy = ready_record("r2", "m", "cpu", "b", 1000.0)
    [old] = endpoints_from(catalog(model("m", cpu_profile())), [legacy], {"b": node("b")}, 1000.0)
    assert old.engine_secret == ""  # served unauthenticated until replaced


def test_every_new_record_gets_a_secret_and_the_current_generation():
    sim = Sim(catalog(model("m", cpu_profile(replicas=2))), {"a": node("a"), "b": node("b")},
              credentials={"*": 1, "m": 2})
    creates = [a for a in sim.reconcile() if isinstance(a, CreateReplica)]
    assert len(creates) == 2 and {a.credential_generation for a in creates} == {3}
    assert all(r.engine_secret and r.credential_generation == 3 for r in sim.records.values())


def test_rotating_rolls_the_model_replicas_new_ready_first():
    sim = Sim(catalog(model("m", gpu_profile(replicas=2)), model("other", cpu_profile())),
              {n: node(n, "h100:2") for n in "abc"})
    sim.converge(3)
    old = set(sim.ready("m"))
    untouched = set(sim.ready("other"))
    assert len(old) == 2
    sim.converge(2)
    assert set(sim.ready("m")) == old  # nothing changes until a rotation
    sim.credentials["m"] = 1
    ready_counts = []
    for _ in range(12):
        sim.converge(1)
        ready_counts.append(len(sim.ready("m")))
    stops = [a for step in sim.history for a in step if isinstance(a, StopReplica)]
    assert stops and all(s.reason == "replaced: engine credentials rotated" for s in stops)
    assert min(ready_counts) >= 2  # the normal rolling update: never below the wanted count
    assert not old & set(sim.records) and len(sim.ready("m")) == 2
    assert all(sim.records[i].credential_generation == 1 for i in sim.ready("m"))
    assert set(sim.ready("other")) == untouched  # only the model asked for


def test_a_record_made_before_credentials_keeps_serving_until_a_rotation():
    sim = Sim(catalog(model("m", cpu_profile())), {"a": node("a")})
    legacy = ready_record("old", "m", "cpu", "a", sim.now, spec_hash=_hash(sim))
    sim.records["old"] = legacy
    assert sim.reconcile() == []
    sim.credentials["*"] = 1  # rotating every model replaces it too
    sim.converge(4)
    assert "old" not in sim.records and [sim.state(i) for i in sim.records] == [State.READY]
    assert next(iter(sim.records.values())).engine_secret


def _hash(sim: Sim) -> str:
    from llmgw.catalog import profile_spec_hash

    m = sim.cat.models[0]
    return profile_spec_hash(m, m.profiles[0])


def test_store_rotation_counts_per_model():
    s = Store(fakeredis.FakeRedis(decode_responses=True))
    assert s.credential_generations() == {}
    assert s.rotate_credentials("m") == 1 and s.rotate_credentials(None) == 1 and s.rotate_credentials("m") == 2
    assert s.credential_generations() == {"m": 2, "*": 1}


def test_the_gateway_sends_the_engine_secret_never_the_client_key(server, store, upstreams):
    import time

    from tests.unit.test_gateway_app import CHAT, endpoint, make_app

    up = upstreams()
    _, gw, c = make_app(store, [endpoint("e1", up.url, engine_secret=SECRET)])
    _, key = store.create_key("team-a")
    gw.keys.refresh()
    auth = {"Authorization": f"Bearer {key}"}
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 200
    assert up.stats["authorization"] == [f"Bearer {SECRET}"]
    # an engine started before credentials existed gets no Authorization at all, still not the client's
    store.write_endpoints([endpoint("e2", up.url)], "fp2", time.time())
    gw.refresh()
    assert c.post(CHAT, json={"model": "m"}, headers=auth).status_code == 200
    assert up.stats["authorization"] == [f"Bearer {SECRET}", None]
