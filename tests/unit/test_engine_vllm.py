"""vLLM adapter: exact command lines, environments, multi-node head/worker, refusals."""

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import EngineUnavailable, LaunchContext
from llmgw.engines.vllm import VllmAdapter


def model(**profile_kw) -> Model:
    p = Profile(**{"name": "a100", "engine": "vllm", "gpu": {"class": "a100"}, **profile_kw})
    return Model(name="llama-8b", aliases=["llama", "l8"], source="meta-llama/Llama-3.1-8B-Instruct", profiles=[p])


def ctx(m: Model, **kw) -> LaunchContext:
    return LaunchContext(replica_id="r1", model=m, profile=m.profiles[0], host="10.0.0.5", port=8101, **kw)


def test_single_node_command_and_gpu_env():
    m = model(tensor_parallel=2, gpu={"class": "a100", "count": 2}, args=["--max-model-len", "8192"],
              env={"HF_HOME": "/data/hf"})
    spec = VllmAdapter(environ={}).command(ctx(m, gpus=(2, 3)))
    assert spec.argv == (
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "10.0.0.5", "--port", "8101",
        "--served-model-name", "llama-8b", "llama", "l8", "--tensor-parallel-size", "2",
        "--max-model-len", "8192",
    )
    assert spec.env == {"HF_HOME": "/data/hf", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert spec.serves_http and spec.health_path == "/health" and spec.metrics_path == "/metrics"


def test_default_start_timeout_is_long():
    assert VllmAdapter(environ={}).command(ctx(model(), gpus=(0,))).start_timeout == 900.0
    assert VllmAdapter(environ={}).command(ctx(model(start_timeout=1800.0), gpus=(0,))).start_timeout == 1800.0


def test_pipeline_parallel_flag_only_when_used():
    spec = VllmAdapter(environ={}).command(ctx(model(tensor_parallel=2, pipeline_parallel=2), gpus=(0, 1, 2, 3)))
    i = spec.argv.index("--pipeline-parallel-size")
    assert spec.argv[i + 1] == "2"
    assert "--pipeline-parallel-size" not in VllmAdapter(environ={}).command(ctx(model(), gpus=(0,))).argv


def test_source_defaults_to_model_name_and_executable_override():
    m = Model(name="Qwen/Qwen2.5-7B", profiles=[Profile(name="p", engine="vllm", gpu={"class": "l4"})])
    spec = VllmAdapter(environ={"LLMGW_VLLM": "/opt/vllm/bin/vllm"}).command(ctx(m, gpus=(0,)))
    assert spec.argv[:3] == ("/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-7B")


def test_multi_node_head_and_worker():
    m = model(tensor_parallel=8, pipeline_parallel=2, nodes=2)
    adapter = VllmAdapter(environ={})
    head = adapter.command(ctx(m, gpus=tuple(range(8)), nnodes=2, node_rank=0, master_addr="10.0.0.5",
                               master_port=30007))
    worker = adapter.command(ctx(m, gpus=tuple(range(8)), nnodes=2, node_rank=1, master_addr="10.0.0.5",
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
        VllmAdapter(environ={}).command(ctx(m, gpus=(0, 1, 2, 3), nnodes=2, node_rank=1))


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
