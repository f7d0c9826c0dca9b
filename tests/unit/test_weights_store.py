"""The weights aggregate of the store: source facts for placement (in the reconcile pass's one read),
the claim that keeps agents from reading one source twice, and pulls with their progress."""

from __future__ import annotations

import fakeredis

from llmgw.state.weights import PullStatus, WeightsFacts
from llmgw.state.store import Store


def store() -> Store:
    return Store(fakeredis.FakeRedis(decode_responses=True))


def test_source_facts_reach_the_fleet_view_and_expired_ones_are_tidied():
    s = store()
    ok = WeightsFacts("hf://o/r/*Q4_1.gguf", "llamacpp", size=100, shape={"layers": 30}, read_at=1.0, node="a")
    bad = WeightsFacts("hf://o/gone", "vllm", error="no repository o/gone", node="a")
    s.write_weights_facts(ok)
    s.write_weights_facts(bad, ttl=30)
    assert s.fleet_view().weights == {ok.source: ok, bad.source: bad}
    assert s.weights_facts([ok.source]) == {ok.source: ok}
    s.r.delete(next(k for k in s.r.keys("llmgw:weights:source:*") if s.r.ttl(k) > 0))  # the error expired
    assert s.fleet_view().weights == {ok.source: ok}
    assert s.r.smembers("llmgw:weights:sources") == {ok.source}


def test_one_agent_claims_a_source_read_until_it_writes_the_facts():
    s = store()
    assert s.claim_weights_read("hf://o/r", "a", 60)
    assert not s.claim_weights_read("hf://o/r", "b", 60)
    s.write_weights_facts(WeightsFacts("hf://o/r", "vllm", size=1))
    assert s.claim_weights_read("hf://o/r", "b", 60)  # written: the claim is gone (a re-read may claim)


def test_pulls_and_their_progress():
    s = store()
    s.request_pull("a", "hf://o/r", "vllm")
    assert s.pull_requests("a") == {"hf://o/r": "vllm"} and s.pull_requests("b") == {}
    s.write_pull_status("a", PullStatus("hf://o/r", "downloading", done=5, total=10))
    assert s.pull_status("a")["hf://o/r"].done == 5 and s.pull_requests("a")
    s.write_pull_status("a", PullStatus("hf://o/r", "complete", done=10, total=10), done=True)
    assert s.pull_requests("a") == {} and s.pull_status("a")["hf://o/r"].phase == "complete"
    s.request_pull("a", "hf://o/r", "vllm")  # asked again: the old outcome goes
    assert s.pull_status("a") == {}
