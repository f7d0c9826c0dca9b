"""The engines' own order: the gateway's rank table, what each engine driver makes a request carry
(`order_fields`, `order_changes`), the scheduling policy vLLM and the sim start with, and the sim's
waiting queue under it."""

import pytest

from llmgw import surface as op
from llmgw.catalog import Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import ORDERED_OPERATIONS, LaunchContext
from llmgw.state.keypolicy import ORDER_RANK, PRIORITIES, PRIORITY_RANK, order_rank
from simengine.core import SimConfig, SimCore


@pytest.mark.parametrize("priority, rank", [
    ("critical", -1),
    ("standard", 0),  # vLLM's default: a standard request's body needs no field
    ("sheddable", 1),
    ("batch", 2),  # a Batch API line ranks last
    ("unheard-of", 0),
])
def test_order_rank(priority, rank):
    assert order_rank(priority) == rank


def test_the_rank_table_covers_every_class_in_the_gateway_s_order():
    assert set(PRIORITIES) <= set(ORDER_RANK)
    # the same order as the gateway's own table (higher there = earlier here)
    ranked = [p for p in PRIORITY_RANK if p in ORDER_RANK]
    assert sorted(ranked, key=order_rank) == sorted(ranked, key=lambda p: -PRIORITY_RANK[p])
    assert max(ORDER_RANK, key=order_rank) == "batch"


@pytest.mark.parametrize("engine, rank, salt, fields", [
    ("vllm", 0, None, {}),
    ("vllm", -1, None, {"priority": -1}),
    ("vllm", 2, None, {"priority": 2}),
    ("vllm", 0, "llmgw-ab", {"cache_salt": "llmgw-ab"}),
    ("vllm", 1, "llmgw-ab", {"priority": 1, "cache_salt": "llmgw-ab"}),
    ("sim", 1, "llmgw-ab", {"priority": 1, "cache_salt": "llmgw-ab"}),
    ("sim", 0, None, {}),
    ("llamacpp", 2, "llmgw-ab", {}),  # one FIFO and one cache: nothing to tell it
    ("external", 2, "llmgw-ab", {}),  # unknown whether it schedules by priority: never a 400 for it
])
def test_order_fields(engine, rank, salt, fields):
    assert get_engine(engine).order_fields(rank, salt) == fields


@pytest.mark.parametrize("engine, body, rank, salt, changes", [
    # the common case: a standard request of a key that shares its cache is sent as the client wrote it
    ("vllm", {"model": "m"}, 0, None, {}),
    ("vllm", {"model": "m"}, 2, None, {"priority": 2}),
    # a client's own priority never jumps the gateway's order: replaced, or put back to vLLM's default
    ("vllm", {"model": "m", "priority": -50}, 1, None, {"priority": 1}),
    ("vllm", {"model": "m", "priority": -50}, 0, None, {"priority": 0}),
    ("vllm", {"model": "m", "priority": True}, 1, None, {"priority": 1}),
    ("vllm", {"model": "m", "priority": 1}, 1, None, {}),  # already right: no rewrite
    # an isolating key's salt replaces the client's; a sharing key's client keeps its own
    ("vllm", {"model": "m", "cache_salt": "mine"}, 0, "llmgw-k", {"cache_salt": "llmgw-k"}),
    ("vllm", {"model": "m", "cache_salt": "mine"}, 0, None, {}),
    ("sim", {"priority": 9}, -1, "llmgw-k", {"priority": -1, "cache_salt": "llmgw-k"}),
    ("llamacpp", {"priority": 9}, -1, "llmgw-k", {}),
])
def test_order_changes(engine, body, rank, salt, changes):
    assert get_engine(engine).order_changes(op.CHAT, body, rank, salt) == changes


def test_only_scheduled_operations_carry_the_order():
    vllm = get_engine("vllm")
    assert ORDERED_OPERATIONS == {op.CHAT, op.COMPLETIONS, op.RESPONSES}
    for operation in (op.CHAT, op.COMPLETIONS, op.RESPONSES):
        assert vllm.order_changes(operation, {}, 2, "s") == {"priority": 2, "cache_salt": "s"}
    for operation in (op.EMBEDDINGS, op.TOKENIZE, op.RERANK, op.RESPONSES_GET):
        assert vllm.order_changes(operation, {"priority": 5}, 2, "s") == {}


def _ctx(engine: str, **kw) -> LaunchContext:
    extra = {"gpu": {"class": "a100"}} if engine == "vllm" else {}
    p = Profile(name="p", engine=engine, **extra, **kw)
    return LaunchContext(replica_id="r1", model=Model(name="m", profiles=[p]), profile=p, host="h", port=1,
                         gpus=(0,) if engine == "vllm" else ())


@pytest.mark.parametrize("engine", ["vllm", "sim"])
def test_vllm_and_the_sim_start_with_the_priority_policy(engine):
    from llmgw.engines.vllm import VllmDriver

    driver = VllmDriver(environ={}) if engine == "vllm" else get_engine(engine)
    argv = driver.command(_ctx(engine)).argv
    assert argv[argv.index("--scheduling-policy") + 1] == "priority" and argv.count("--scheduling-policy") == 1


@pytest.mark.parametrize("engine", ["vllm", "sim"])
@pytest.mark.parametrize("args", [["--scheduling-policy", "fcfs"], ["--scheduling-policy=priority"]])
def test_a_profile_may_not_set_the_scheduling_policy(engine, args):
    extra = {"gpu": {"class": "a100"}} if engine == "vllm" else {}
    problems = get_engine(engine).refusals(Profile(name="p", engine=engine, args=args, **extra))
    assert [p.path for p in problems] == ["args"]
    assert "'--scheduling-policy' is set by llmgw" in problems[0].reason


# --- the simulated engine's waiting queue -----------------------------------------------------

def _admitted(policy: str, arrivals: list[tuple[str, int]]) -> list[str]:
    """The order in which one slot admits `arrivals` (rid, priority), all waiting behind a running one."""
    core = SimCore(SimConfig(max_seqs=1, policy=policy, step_ms=1.0))
    core.submit("running", 1, 1, 0.0, priority=5)
    step = core.plan_step(0.0)
    assert step is not None and step.batch == ("running",)
    for i, (rid, prio) in enumerate(arrivals):
        core.submit(rid, 1, 1, 0.001 * (i + 1), priority=prio)
    order, now = [], 0.0
    while step is not None:
        order += list(step.prefill)
        now += step.duration
        core.finish_step(step, now)
        step = core.plan_step(now)
    return order[1:]


@pytest.mark.parametrize("policy, arrivals, order", [
    ("priority", [("batch", 2), ("shed", 1), ("std", 0), ("crit", -1)], ["crit", "std", "shed", "batch"]),
    ("priority", [("a", 1), ("b", 0), ("c", 1), ("d", 0)], ["b", "d", "a", "c"]),  # ties: arrival order
    ("fcfs", [("batch", 2), ("shed", 1), ("std", 0), ("crit", -1)], ["batch", "shed", "std", "crit"]),
])
def test_the_sim_admits_waiting_requests_in_priority_order(policy, arrivals, order):
    assert _admitted(policy, arrivals) == order


def test_the_sim_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="policy must be one of fcfs, priority"):
        SimConfig(policy="lifo")


# --- the gateway's side: the Plan carries the order, each attempt's body gets its engine's fields ---

def _endpoint(engine: str):
    from llmgw.state.records import EndpointInfo

    return EndpointInfo(id=engine, url=f"http://{engine}", models=("m",), engine=engine, served_name="m", model="m")


def _call(**extra):
    import json

    from gateway.request.call import Call
    from gateway.request.surface import ROUTES

    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 200}], **extra}).encode()
    return Call(ROUTES[op.CHAT], "m", raw, json.loads(raw))


@pytest.mark.parametrize("priority, salt, engine, sent", [
    ("standard", None, "vllm", None),  # the client's bytes, unchanged
    ("batch", None, "vllm", {"priority": 2}),
    ("critical", "llmgw-k", "sim", {"priority": -1, "cache_salt": "llmgw-k"}),
    ("batch", "llmgw-k", "llamacpp", None),  # llama-server takes neither
])
def test_each_attempt_sends_what_its_engine_orders_and_caches_by(priority, salt, engine, sent):
    import json

    from gateway.request.call import engine_request
    from gateway.request.plan import plan
    from gateway.routing.tables import EMPTY

    call = _call(stream=True)  # (a whole answer from llama-server is asked for as a stream: another change)
    p = plan(call, EMPTY.tables, priority, None, None, cache_salt=salt)
    assert (p.rank, p.cache_salt) == (order_rank(priority), salt)
    body = engine_request(call, p.adapter, _endpoint(engine), p.rank, p.cache_salt).body
    if sent is None:
        assert body is call.data
    else:
        assert json.loads(body) == {**call.body, **sent}


def test_an_isolating_key_s_prompts_match_no_other_key_s_prefix():
    from gateway.request.plan import plan
    from gateway.routing.tables import EMPTY

    def keys(call, salt=None):
        return plan(call, EMPTY.tables, "standard", None, None, cache_salt=salt).prefix

    shared = keys(_call())
    assert shared and keys(_call(cache_salt="mine")) != shared  # a client's own salt, as the engine sees it
    a, b = keys(_call(), "llmgw-a"), keys(_call(cache_salt="mine"), "llmgw-a")
    assert a == b and set(a).isdisjoint(shared)  # the key's salt replaces the client's
    assert set(keys(_call(), "llmgw-b")).isdisjoint(a)
