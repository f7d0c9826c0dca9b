"""vLLM engine driver: exact command lines, environments, multi-node head/worker, refusals."""

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import EngineUnavailable, LaunchContext
from llmgw.engines.vllm import VllmDriver


def model(**profile_kw) -> Model:
    p = Profile(**{"name": "a100", "engine": "vllm", "gpu": {"class": "a100"}, **profile_kw})
    return Model(name="llama-8b", aliases=["llama", "l8"], source="meta-llama/Llama-3.1-8B-Instruct", profiles=[p])


def ctx(m: Model, **kw) -> LaunchContext:
    return LaunchContext(replica_id="r1", model=m, profile=m.profiles[0], host="10.0.0.5", port=8101, **kw)


def test_single_node_command_and_gpu_env():
    m = model(tensor_parallel=2, gpu={"class": "a100", "count": 2}, args=["--max-model-len", "8192"],
              env={"HF_HOME": "/data/hf"})
    spec = VllmDriver(environ={}).command(ctx(m, gpus=(2, 3)))
    assert spec.argv == (
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "10.0.0.5", "--port", "8101",
        "--served-model-name", "llama-8b", "llama", "l8", "--tensor-parallel-size", "2",
        "--scheduling-policy", "priority", "--max-model-len", "8192",
    )
    assert spec.env == {"HF_HOME": "/data/hf", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert spec.serves_http and spec.health_path == "/health" and spec.metrics_path == "/metrics"


def test_default_start_timeout_is_long():
    assert VllmDriver(environ={}).command(ctx(model(), gpus=(0,))).start_timeout == 900.0
    assert VllmDriver(environ={}).command(ctx(model(start_timeout=1800.0), gpus=(0,))).start_timeout == 1800.0


def test_pipeline_parallel_flag_only_when_used():
    spec = VllmDriver(environ={}).command(ctx(model(tensor_parallel=2, pipeline_parallel=2), gpus=(0, 1, 2, 3)))
    i = spec.argv.index("--pipeline-parallel-size")
    assert spec.argv[i + 1] == "2"
    assert "--pipeline-parallel-size" not in VllmDriver(environ={}).command(ctx(model(), gpus=(0,))).argv


def test_source_defaults_to_model_name_and_executable_override():
    m = Model(name="Qwen/Qwen2.5-7B", profiles=[Profile(name="p", engine="vllm", gpu={"class": "l4"})])
    spec = VllmDriver(environ={"LLMGW_VLLM": "/opt/vllm/bin/vllm"}).command(ctx(m, gpus=(0,)))
    assert spec.argv[:3] == ("/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-7B")


def test_multi_node_head_and_worker():
    m = model(tensor_parallel=8, pipeline_parallel=2, nodes=2)
    driver = VllmDriver(environ={})
    head = driver.command(ctx(m, gpus=tuple(range(8)), nnodes=2, node_rank=0, master_addr="10.0.0.5",
                               master_port=30007))
    worker = driver.command(ctx(m, gpus=tuple(range(8)), nnodes=2, node_rank=1, master_addr="10.0.0.5",
                                 master_port=30007))
    tail = ("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5", "--master-port", "30007")
    assert head.argv[-len(tail):] == tail and head.serves_http
    assert "--headless" not in head.argv
    assert worker.argv[-9:] == ("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5",
                                "--master-port", "30007", "--headless")
    assert not worker.serves_http
    assert head.env["CUDA_VISIBLE_DEVICES"] == worker.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "--ray" not in " ".join(head.argv)  # no Ray


def test_multi_node_without_master_address_is_a_clear_error():
    m = model(tensor_parallel=8, nodes=2)
    with pytest.raises(EngineUnavailable, match="master address"):
        VllmDriver(environ={}).command(ctx(m, gpus=(0, 1, 2, 3), nnodes=2, node_rank=1))


def test_refuses_a_profile_without_gpu():
    p = Profile(name="cpu", engine="vllm")
    assert [x.path for x in get_engine("vllm").refusals(p)] == ["gpu"]
    assert get_engine("vllm").refusals(model(tensor_parallel=2, nodes=2).profiles[0]) == []


def test_default_metric_mapping():
    a = get_engine("vllm")
    assert (a.default_metrics.running, a.default_metrics.waiting, a.default_metrics.kv_usage) == (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert a.kv_fallbacks == ("vllm:gpu_cache_usage_perc",)
    assert a.token_metrics(model().profiles[0]) == ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


# --- LoRA adapters ----------------------------------------------------------------------------

def test_lora_profile_enables_runtime_adapters():
    m = model(lora={"max_loras": 4, "max_lora_rank": 64, "max_cpu_loras": 16}, args=["--max-model-len", "8192"])
    spec = VllmDriver(environ={}).command(ctx(m, gpus=(0,)))
    a = spec.argv
    assert a[a.index("--scheduling-policy") + 2:] == (
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "16",
        "--max-model-len", "8192")
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # No --lora-modules: the agent loads each adapter after /health (a bad one must not stop the server).
    assert "--lora-modules" not in a


def test_lora_defaults_and_no_lora():
    a = VllmDriver(environ={}).command(ctx(model(lora={}), gpus=(0,))).argv
    assert a[-5:] == ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "16")
    spec = VllmDriver(environ={}).command(ctx(model(), gpus=(0,)))
    assert "--enable-lora" not in spec.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in spec.env


def test_lora_flags_on_every_node_of_a_multi_node_replica():
    m = model(tensor_parallel=2, nodes=2, gpu={"class": "a100", "count": 1}, lora={"max_loras": 2})
    for rank in (0, 1):
        spec = VllmDriver(environ={}).command(ctx(m, gpus=(0,), nnodes=2, node_rank=rank, master_addr="10.0.0.1"))
        assert "--enable-lora" in spec.argv and spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_lora_refusals():
    v = get_engine("vllm")
    assert [(p.path, p.reason) for p in v.refusals(model(lora={"max_lora_rank": 24}).profiles[0])] == [
        ("lora.max_lora_rank", "vllm takes a max_lora_rank of 1, 8, 16, 32, 64, 128, 256, 320, 512; got 24")]
    for rank in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        assert v.refusals(model(lora={"max_lora_rank": rank}).profiles[0]) == []
    assert [p.path for p in v.refusals(model(lora={"max_loras": 3, "max_cpu_loras": 2}).profiles[0])] == [
        "lora.max_cpu_loras"]
    assert [p.path for p in v.refusals(model(args=["--enable-lora"]).profiles[0])] == ["args"]
    assert v.adapter_source_refusal("/adapters/sql") is None and v.adapter_source_refusal("org/sql-lora") is None
    assert "not GGUF" in v.adapter_source_refusal("/a/x.gguf")
    assert "not pkg:" in v.adapter_source_refusal("pkg:llm_x/a")


def test_load_and_unload_calls():
    v = get_engine("vllm")
    load = v.adapter_load_call("sql", "/adapters/sql")
    assert (load.method, load.path, load.body) == ("POST", "/v1/load_lora_adapter",
                                                   {"lora_name": "sql", "lora_path": "/adapters/sql"})
    unload = v.adapter_unload_call("sql")
    assert (unload.method, unload.path, unload.body) == ("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})


# The answers vLLM gives (vllm/entrypoints/openai/models/serving.py; older releases use the flat
# error shape): what each means for the wanted state.
NEW_ERR = '{"error": {"message": "%s", "type": "%s", "param": null, "code": %d}}'
OLD_ERR = '{"object": "error", "message": "%s", "type": "%s", "param": null, "code": %d}'


@pytest.mark.parametrize("shape", [NEW_ERR, OLD_ERR])
def test_load_outcomes(shape):
    v = get_engine("vllm")
    load = v.adapter_load_call("sql", "/adapters/sql")
    assert v.adapter_outcome(load, 200, "Success: LoRA adapter 'sql' added successfully.").done
    already = shape % ("The lora adapter 'sql' has already been loaded.", "InvalidUserInput", 400)
    assert v.adapter_outcome(load, 400, already).done
    missing = shape % ("Loading lora sql failed: No adapter found for /adapters/sql", "NotFoundError", 404)
    out = v.adapter_outcome(load, 404, missing)
    assert not out.done and "found no adapter at '/adapters/sql'" in out.reason and "No adapter found" in out.reason
    rank = shape % ("LoRA rank 64 is greater than max_lora_rank 16.", "InternalServerError", 500)
    out = v.adapter_outcome(load, 500, rank)
    assert not out.done and out.reason == "vLLM answered 500: LoRA rank 64 is greater than max_lora_rank 16."
    out = v.adapter_outcome(load, 404, "Not Found")  # runtime loading not allowed: the route does not exist
    assert not out.done and "Not Found" in out.reason


def test_unload_outcomes():
    v = get_engine("vllm")
    unload = v.adapter_unload_call("sql")
    assert v.adapter_outcome(unload, 200, "Success: LoRA adapter 'sql' removed successfully.").done
    gone = NEW_ERR % ("The lora adapter 'sql' cannot be found.", "NotFoundError", 404)
    assert v.adapter_outcome(unload, 404, gone).done  # not held: what was wanted
    assert not v.adapter_outcome(unload, 500, NEW_ERR % ("Failed to remove", "InternalServerError", 500)).done


def test_a_request_for_an_adapter_names_it_as_the_model():
    from llmgw.catalog import Adapter

    v = get_engine("vllm")
    sql = Adapter(name="sql", aliases=["q"], source="/adapters/sql", rank=8)
    body = {"model": "q", "messages": []}
    assert v.adapter_body(body, sql, ()) == {"model": "sql", "messages": []}
    assert v.adapter_body(body, None, ("sql",)) is body
    assert body == {"model": "q", "messages": []}


def lora_metrics(*series: tuple[str, str, float], max_lora: str = "2") -> str:
    """/metrics text as vLLM's PrometheusStatLogger writes it: one series per label set it ever had."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    reg = CollectorRegistry()
    g = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
              ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg)
    for running, waiting, at in series:
        g.labels(max_lora=max_lora, waiting_lora_adapters=waiting, running_lora_adapters=running).set(at)
    Gauge("vllm:num_requests_running", "Running", ["model_name", "engine"], registry=reg).labels("m", "0").set(3)
    return generate_latest(reg).decode()


def test_lora_activity_is_the_latest_series():
    from llmgw.engines.vllm import LoraActivity, read_lora_activity

    text = lora_metrics(("sql", "", 1_700_000_000.0), ("sql,support", "chat", 1_700_000_009.5), ("", "", 1_700_000_004.0))
    assert read_lora_activity(text) == LoraActivity(running=("sql", "support"), waiting=("chat",), max_loras=2)
    assert read_lora_activity(lora_metrics(("", "", 5.0))) == LoraActivity(max_loras=2)
    assert read_lora_activity(lora_metrics(max_lora="")) is None  # no series at all (LoRA not enabled)
    assert read_lora_activity(lora_metrics(("a", "", 1.0), max_lora="x")).max_loras is None
    with pytest.raises(ValueError):
        read_lora_activity("<html>not metrics</html>\n")
