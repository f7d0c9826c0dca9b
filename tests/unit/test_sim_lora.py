"""The sim engine's LoRA adapters (simengine/lora.py, simengine/core.py) and the sim engine driver's LoRA side
(llmgw/engines/sim.py): vLLM's load and unload answers, at most max_loras distinct adapters in a
batch (a request for another one waits, as in vLLM's scheduler), the vllm:lora_requests_info series
llmgw reads back, and the command line a profile with `lora:` gets."""

from __future__ import annotations

import json

from llmgw.catalog import parse_catalog_text
from llmgw.engines import get_engine
from llmgw.engines.base import LaunchContext
from llmgw.engines.vllm import read_lora_activity
from simengine.core import SimConfig, SimCore
from simengine.lora import Adapters, LoraInfo, LoraOptions, runtime_allowed
from simengine.metrics import Histogram, Snapshot, render_vllm


def adapter_dir(tmp_path, name, rank=8):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": rank}))
    return str(d)


def reply(r):
    return r.status, (json.loads(r.body)["error"]["message"] if r.ctype == "application/json" else r.body.decode())


def test_load_and_unload_answer_as_vllm(tmp_path):
    sleeps = []
    ads = Adapters(LoraOptions(max_loras=1, max_lora_rank=16, load_time=0.5, runtime=True), sleep=sleeps.append)
    a1 = adapter_dir(tmp_path, "a1")
    assert reply(ads.load({"lora_name": "a1", "lora_path": a1})) == (200, "Success: LoRA adapter 'a1' added successfully.")
    assert sleeps == [0.5]
    assert reply(ads.load({"lora_name": "a1", "lora_path": a1})) == (400, "The lora adapter 'a1' has already been loaded.")
    assert reply(ads.load({"lora_name": "a2"})) == (400, "Both 'lora_name' and 'lora_path' must be provided.")
    assert reply(ads.load({"lora_name": "a2", "lora_path": str(tmp_path / "nope")})) == (
        404, f"Loading lora a2 failed: No adapter found for {tmp_path / 'nope'}")
    big = adapter_dir(tmp_path, "big", rank=64)
    assert reply(ads.load({"lora_name": "big", "lora_path": big})) == (400, "LoRA rank 64 is greater than max_lora_rank 16.")
    full = reply(ads.load({"lora_name": "a3", "lora_path": a1}))
    assert full[0] == 400 and "1 adapters are loaded" in full[1]
    assert ads.names() == ("a1",)
    assert ads.cards("base", 7) == [{"id": "a1", "object": "model", "created": 7, "owned_by": "vllm", "root": a1,
                                     "parent": "base"}]
    assert reply(ads.unload({"lora_name": "a1"})) == (200, "Success: LoRA adapter 'a1' removed successfully.")
    assert reply(ads.unload({"lora_name": "a1"})) == (404, "The lora adapter 'a1' cannot be found.")
    assert runtime_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) and not runtime_allowed({})


def test_a_batch_holds_at_most_max_loras_distinct_adapters():
    core = SimCore(SimConfig(max_seqs=8, max_loras=2))
    for rid, adapter in [("r1", "a"), ("r2", "b"), ("r3", "c"), ("r4", "a"), ("r5", None)]:
        core.submit(rid, 4, 2, 0.0, adapter=adapter)
    step = core.plan_step(0.0)
    assert set(step.batch) == {"r1", "r2", "r4", "r5"}  # c waits; those behind it are not held up
    assert core.lora_running == ("a", "b") and core.lora_waiting == ("c",)
    core.finish_step(step, 1.0)
    core.finish_step(core.plan_step(1.0), 2.0)  # two tokens each: all four done
    step = core.plan_step(2.0)
    assert step.batch == ("r3",) and core.lora_waiting == ()  # once a and b left the batch


def test_the_lora_gauge_is_read_back_as_the_latest_series():
    info = LoraInfo(max_loras=2)
    info.observe(("a",), (), 10.0)
    series = info.observe(("a", "b"), ("c",), 20.0)
    snap = Snapshot(running=2, waiting=1, kv_usage=0.1, prompt_tokens_total=1, generation_tokens_total=1,
                    success_total={}, ttft=Histogram((1.0,)), e2e=Histogram((1.0,)), started=0.0,
                    lora_info=tuple(series))
    act = read_lora_activity(render_vllm(snap, "base"))
    assert (act.running, act.waiting, act.max_loras) == (("a", "b"), ("c",), 2)
    assert "lora_requests_info" not in render_vllm(Snapshot(0, 0, 0.0, 0, 0, {}, Histogram((1.0,)), Histogram((1.0,)), 0.0), "b")


def test_a_sim_profile_with_lora_starts_as_vllm_would():
    cat = parse_catalog_text("""
models:
  - name: base
    profiles:
      - {name: p, engine: sim, args: ["--lora-load-time", "0.2"], lora: {max_loras: 3, max_lora_rank: 32, max_cpu_loras: 4}}
""")
    m = cat.model("base")
    spec = get_engine("sim").command(LaunchContext("r1", m, m.profiles[0], "127.0.0.1", 9000))
    argv = list(spec.argv)
    assert argv[argv.index("--enable-lora"):argv.index("--enable-lora") + 7] == [
        "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "4"]
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and argv[-2:] == ["--lora-load-time", "0.2"]
    sim = get_engine("sim")
    call = sim.adapter_load_call("a1", "/ad/a1")
    assert (call.path, call.body) == ("/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "/ad/a1"})
    assert sim.adapter_outcome(call, 400, json.dumps({"error": {"message": "The lora adapter 'a1' has already been "
                                                                          "loaded."}})).done
