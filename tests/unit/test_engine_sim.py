"""Sim adapter: command line, environment, metric styles."""

import sys

from llmgw.catalog import MetricMapping, Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import LaunchContext


def ctx(**profile_kw) -> LaunchContext:
    p = Profile(name="sim", engine="sim", **profile_kw)
    m = Model(name="m", aliases=["m-alias"], profiles=[p])
    return LaunchContext(replica_id="r1", model=m, profile=p, host="127.0.0.1", port=9100)


def test_command_line():
    spec = get_engine("sim").command(ctx(capacity=3, args=["--speed", "4"], env={"X": "1"}))
    assert spec.argv == (sys.executable, "-m", "llmgw.simengine", "--host", "127.0.0.1", "--port", "9100",
                         "--served-model-name", "m", "m-alias", "--max-seqs", "3", "--speed", "4")
    assert spec.env == {"X": "1"} and spec.serves_http and spec.health_path == "/health"


def test_explicit_max_seqs_in_args_wins_over_capacity():
    argv = get_engine("sim").command(ctx(capacity=3, args=["--max-seqs", "7"])).argv
    assert argv.count("--max-seqs") == 1 and argv[-2:] == ("--max-seqs", "7")


def test_no_gpu_needed_and_gpu_env_when_given():
    a = get_engine("sim")
    assert a.refusals(Profile(name="s", engine="sim")) == []
    p = Profile(name="s", engine="sim", gpu={"class": "fake"})
    c = LaunchContext(replica_id="r", model=Model(name="m", profiles=[p]), profile=p, host="h", port=1, gpus=(0, 2))
    assert a.command(c).env["CUDA_VISIBLE_DEVICES"] == "0,2"


def test_metric_style_switches_default_mapping_and_token_counters():
    a = get_engine("sim")
    vllm = Profile(name="s", engine="sim")
    llama = Profile(name="s", engine="sim", args=["--metrics-style", "llamacpp"])
    assert a.effective_metrics(vllm).running == "vllm:num_requests_running"
    assert a.effective_metrics(llama).running == "llamacpp:requests_processing"
    assert a.token_metrics(llama) == ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")
    own = Profile(name="s", engine="sim", args=["--metrics-style=llamacpp"],
                  metrics=MetricMapping(running="llamacpp:requests_processing", waiting="llamacpp:requests_deferred"))
    assert a.effective_metrics(own).kv_usage is None


def test_bad_sim_args_are_refused_with_the_reason():
    a = get_engine("sim")
    problems = a.refusals(Profile(name="s", engine="sim", args=["--speed", "fast", "--bogus"]))
    assert [p.path for p in problems] == ["args"]
    assert "'fast' is not a number" in problems[0].reason
    problems = a.refusals(Profile(name="s", engine="sim", args=["--bogus", "1"]))
    assert [str(p) for p in problems] == ["args: unknown simengine option(s): --bogus 1"]
    assert a.refusals(Profile(name="s", engine="sim", args=["--speed", "2", "--metrics-style=llamacpp"])) == []
