"""The /metrics -> load mapping, on recorded text from llama-server and vLLM-shaped fixtures."""

from pathlib import Path

import pytest

from llmgw.catalog import MetricMapping, Profile
from llmgw.engines import get_engine
from llmgw.engines.metrics import MappedLoad, MetricsMalformed, read_kv_tokens, read_load

FIX = Path(__file__).parents[1] / "fixtures" / "metrics"
VLLM = Profile(name="gpu", engine="vllm", gpu={"class": "a100"})
LLAMA = Profile(name="cpu", engine="llamacpp")


def text(name: str) -> str:
    return (FIX / name).read_text()


def test_vllm_0_10_single_engine():
    load = read_load(text("vllm_0_10_single.txt"), get_engine("vllm"), VLLM)
    assert load == MappedLoad(running=7, waiting=3, kv_usage=pytest.approx(0.4213),
                              prompt_tokens_total=182734, generation_tokens_total=93821,
                              prefix_queries_total=182734, prefix_hits_total=60911,  # the prefix cache, in tokens
                              kv_tokens=27034 * 16)  # vllm:cache_config_info: num_gpu_blocks x block_size


def test_vllm_data_parallel_sums_counts_and_averages_kv():
    load = read_load(text("vllm_0_12_dp2.txt"), get_engine("vllm"), VLLM)
    assert (load.running, load.waiting) == (11, 2)
    assert load.kv_usage == pytest.approx(0.4)
    assert (load.prompt_tokens_total, load.generation_tokens_total) == (3000, 1200)
    assert load.kv_tokens == 2 * 27034 * 16  # one cache per engine


def test_the_kv_cache_size_is_unknown_until_every_engine_says_it():
    line = 'vllm:cache_config_info{block_size="%s",engine="%s",num_gpu_blocks="%s",sliding_window="None"} 1.0\n'
    assert read_kv_tokens(line % ("16", "0", "661"), "vllm:cache_config_info") == 10576
    # Before the cache is allocated vLLM writes "None"; with one engine of two unknown, the sum would lie.
    assert read_kv_tokens(line % ("16", "0", "None"), "vllm:cache_config_info") is None
    assert read_kv_tokens(line % ("16", "0", "661") + line % ("16", "1", "None"), "vllm:cache_config_info") is None
    assert read_kv_tokens(line % ("16", "0", "0"), "vllm:cache_config_info") is None
    assert read_kv_tokens("vllm:num_requests_running 1\n", "vllm:cache_config_info") is None
    assert read_kv_tokens(line % ("16", "0", "661"), None) is None
    # llama-server says nothing of the kind: unknown, and the gateway uses the catalog's figure or its default.
    assert read_load(text("llamacpp_busy.txt"), get_engine("llamacpp"), LLAMA).kv_tokens is None


def test_vllm_legacy_kv_name_is_the_fallback():
    load = read_load(text("vllm_0_6_legacy.txt"), get_engine("vllm"), VLLM)
    assert (load.running, load.waiting, load.kv_usage) == (2, 1, pytest.approx(0.15))


def test_new_kv_name_is_preferred_over_the_old_one():
    t = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.7\n'
         'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.1\n')
    assert read_load(t, get_engine("vllm"), VLLM).kv_usage == pytest.approx(0.7)


def test_llamacpp_recorded_busy_and_idle():
    busy = read_load(text("llamacpp_busy.txt"), get_engine("llamacpp"), LLAMA)
    assert busy == MappedLoad(running=4, waiting=2, kv_usage=None, prompt_tokens_total=144, generation_tokens_total=16,
                              prefill_seconds_total=pytest.approx(0.678502))
    idle = read_load(text("llamacpp_idle.txt"), get_engine("llamacpp"), LLAMA)
    assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, None)  # 0 is reported, KV is unknown


def test_llamacpp_mapping_naming_kv_ratio_yields_none_not_zero():
    p = Profile(name="cpu", engine="llamacpp", metrics=MetricMapping(
        running="llamacpp:requests_processing", waiting="llamacpp:requests_deferred",
        kv_usage="llamacpp:kv_cache_usage_ratio"))
    assert read_load(text("llamacpp_busy.txt"), get_engine("llamacpp"), p).kv_usage is None
    # ...and an older build that has the series reports it.
    older = text("llamacpp_busy.txt") + "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.25\n"
    assert read_load(older, get_engine("llamacpp"), p).kv_usage == pytest.approx(0.25)


def test_complete_mapping_leaves_blanks_unknown_even_if_the_default_exists():
    p = Profile(name="gpu", engine="vllm", gpu={"class": "a100"},
                metrics=MetricMapping(running="vllm:num_requests_running"))
    load = read_load(text("vllm_0_10_single.txt"), get_engine("vllm"), p)
    assert (load.running, load.waiting, load.kv_usage) == (7, None, None)


def test_partial_mapping_is_filled_from_defaults_and_custom_names_have_no_fallback():
    p = Profile(name="gpu", engine="vllm", gpu={"class": "a100"},
                metrics=MetricMapping(kv_usage="my:kv"))
    load = read_load(text("vllm_0_6_legacy.txt"), get_engine("vllm"), p)
    assert (load.running, load.waiting, load.kv_usage) == (2, 1, None)


def test_counter_named_without_total_suffix():
    p = Profile(name="cpu", engine="llamacpp", metrics=MetricMapping(
        running="llamacpp:n_decode", waiting="llamacpp:n_tokens_max"))
    load = read_load(text("llamacpp_busy.txt"), get_engine("llamacpp"), p)
    assert (load.running, load.waiting) == (24, 47)


def test_absent_series_and_empty_text_are_unknown():
    assert read_load("", get_engine("vllm"), VLLM) == MappedLoad()
    assert read_load("other_metric 1\n", get_engine("llamacpp"), LLAMA) == MappedLoad()


def test_nan_is_unknown():
    t = "vllm:num_requests_running NaN\nvllm:num_requests_waiting 2\n"
    load = read_load(t, get_engine("vllm"), VLLM)
    assert (load.running, load.waiting) == (None, 2)


@pytest.mark.parametrize("bad", ["<html><body>502 Bad Gateway</body></html>",
                                 'vllm:num_requests_running{engine="0" 3\n',
                                 "vllm:num_requests_running three\n"])
def test_malformed_text_raises_a_clear_value_error(bad):
    with pytest.raises(MetricsMalformed, match="malformed metrics text") as e:
        read_load(bad, get_engine("vllm"), VLLM)
    assert isinstance(e.value, ValueError)
    assert e.value.line is not None
