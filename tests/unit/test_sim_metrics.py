"""The sim's /metrics text parses, and maps through the same engine drivers as the real engines."""

from llmgw.catalog import Profile
from llmgw.engines import get_engine
from llmgw.engines.metrics import read_load
from simengine.metrics import E2E_BUCKETS, TTFT_BUCKETS, Histogram, Snapshot, render_llamacpp, render_vllm


def snap(**kw) -> Snapshot:
    ttft = Histogram(TTFT_BUCKETS)
    for v in (0.003, 0.05, 0.05, 3.0):
        ttft.observe(v)
    base = dict(running=3, waiting=2, kv_usage=0.25, prompt_tokens_total=120, generation_tokens_total=48,
                success_total={"length": 4}, ttft=ttft, e2e=Histogram(E2E_BUCKETS), started=1.7e9,
                busy_seconds_prompt=0.5, busy_seconds_decode=2.0, n_decode_total=24, max_seq_tokens=40,
                prefix_queries=100, prefix_hits=60)
    return Snapshot(**{**base, **kw})


def test_vllm_style_maps_with_the_vllm_defaults():
    text = render_vllm(snap(), "m")
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in text
    assert "vllm:time_to_first_token_seconds_bucket" in text and "vllm:prompt_tokens_created" in text
    load = read_load(text, get_engine("sim"), Profile(name="s", engine="sim"))
    assert (load.running, load.waiting, load.kv_usage) == (3, 2, 0.25)
    assert (load.prompt_tokens_total, load.generation_tokens_total) == (120, 48)
    assert (load.prefix_queries_total, load.prefix_hits_total) == (100, 60)  # vLLM's prefix-cache counters
    assert load.prefill_seconds_total == 0.5  # vllm:request_prefill_time_seconds_sum
    # vllm:request_prefill_kv_computed_tokens_sum: the prompt tokens computed, counted with those seconds
    assert snap(prompt_cached_total=20).prompt_tokens_total - 20 == read_load(
        render_vllm(snap(prompt_cached_total=20), "m"), get_engine("sim"),
        Profile(name="s", engine="sim")).prefill_tokens_total == 100
    llama = read_load(render_llamacpp(snap()), get_engine("sim"), Profile(name="s", engine="sim", args=["--metrics-style", "llamacpp"]))
    assert llama.prefill_tokens_total is None  # llama.cpp counts its seconds with its prompt tokens


def test_ttft_histogram_is_cumulative():
    text = render_vllm(snap(), "m")
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="m"} 1.0' in text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="m"} 3.0' in text
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0' in text


def test_llamacpp_style_looks_like_llama_server():
    text = render_llamacpp(snap())
    assert "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 3\n" in text
    assert "kv_cache" not in text  # like current builds
    p = Profile(name="s", engine="sim", args=["--metrics-style", "llamacpp"])
    load = read_load(text, get_engine("sim"), p)
    assert (load.running, load.waiting, load.kv_usage) == (3, 2, None)
    assert (load.prompt_tokens_total, load.generation_tokens_total) == (120, 48)
    assert (load.prefix_queries_total, load.prefix_hits_total, load.prefill_seconds_total) == (None, None, 0.5)
