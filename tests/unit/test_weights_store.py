"""The weights aggregate of the store: source facts for placement (in the reconcile pass's one read),
the claim that keeps agents from reading one source twice, and pulls with their progress."""

from __future__ import annotations

from llmgw.state.weights import PullStatus, WeightsFacts


def test_source_facts_reach_the_fleet_view_and_expired_ones_are_tidied(store):
    ok = WeightsFacts("hf://o/r/*Q4_1.gguf", "llamacpp", size=100, shape={"layers": 30}, read_at=1.0, node="a")
    bad = WeightsFacts("hf://o/gone", "vllm", error="no repository o/gone", node="a")
    store.write_weights_facts(ok)
    store.write_weights_facts(bad, ttl=30)
    assert store.fleet_view().weights == {ok.source: ok, bad.source: bad}
    assert store.weights_facts([ok.source]) == {ok.source: ok}
    store.r.delete(next(k for k in store.r.keys("llmgw:weights:source:*") if store.r.ttl(k) > 0))  # the error expired
    assert store.fleet_view().weights == {ok.source: ok}
    assert store.r.smembers("llmgw:weights:sources") == {ok.source}


def test_one_agent_claims_a_source_read_until_it_writes_the_facts(store):
    assert store.claim_weights_read("hf://o/r", "a", 60)
    assert not store.claim_weights_read("hf://o/r", "b", 60)
    store.write_weights_facts(WeightsFacts("hf://o/r", "vllm", size=1))
    assert store.claim_weights_read("hf://o/r", "b", 60)  # written: the claim is gone (a re-read may claim)


def test_pulls_and_their_progress(store):
    store.request_pull("a", "hf://o/r", "vllm")
    assert store.pull_requests("a") == {"hf://o/r": "vllm"} and store.pull_requests("b") == {}
    store.write_pull_status("a", PullStatus("hf://o/r", "downloading", done=5, total=10))
    assert store.pull_status("a")["hf://o/r"].done == 5 and store.pull_requests("a")
    store.write_pull_status("a", PullStatus("hf://o/r", "complete", done=10, total=10), done=True)
    assert store.pull_requests("a") == {} and store.pull_status("a")["hf://o/r"].phase == "complete"
    store.request_pull("a", "hf://o/r", "vllm")  # asked again: the old outcome goes
    assert store.pull_status("a") == {}
