"""The KV cache's size, which sizes the gateway's index of what it sent each replica: declared in the
catalog (`kv_cache_tokens`), published with the endpoint; reported by the engine (vLLM's
vllm:cache_config_info, the sim's too), scraped into the LoadRecord."""

from __future__ import annotations

import pytest

from llmgw.errors import CatalogInvalid
from simengine.metrics import E2E_BUCKETS, TTFT_BUCKETS, Histogram, Snapshot, render_llamacpp, render_vllm
from tests.unit.control_support import catalog, cpu_profile, model, node, ready_record
from workers.agent.scrape import ScrapeTarget, scrape_one
from workers.control.publish import endpoints_from

NOW = 1000.0


def test_the_catalogs_figure_is_checked_and_published():
    with pytest.raises(CatalogInvalid) as exc:
        catalog(model("m", cpu_profile("s", kv_cache_tokens=0)))
    assert "kv_cache_tokens" in str(exc.value) and "256" in str(exc.value)
    with pytest.raises(CatalogInvalid) as exc:
        catalog(model("m", cpu_profile("s", kv_cache_tokens="lots")))
    assert "kv_cache_tokens" in str(exc.value)
    cat = catalog(model("m", cpu_profile("s", kv_cache_tokens=49152), cpu_profile("plain")))
    recs = [ready_record("a", "m", "s", "n1", NOW), ready_record("b", "m", "plain", "n1", NOW)]
    eps = {e.id: e for e in endpoints_from(cat, recs, {"n1": node("n1")}, NOW)}
    assert (eps["a"].kv_tokens, eps["b"].kv_tokens) == (49152, None)


def _snap(**kw) -> Snapshot:
    return Snapshot(running=1, waiting=0, kv_usage=0.1, prompt_tokens_total=5, generation_tokens_total=3,
                    success_total={}, ttft=Histogram(TTFT_BUCKETS), e2e=Histogram(E2E_BUCKETS), started=1.7e9, **kw)


class _Fetch:
    def __init__(self, text):
        self.text = text

    def __call__(self, url, timeout, secret=None):
        return self.text


def test_the_sim_reports_its_kv_budget_as_vllm_does_and_the_agent_scrapes_it():
    text = render_vllm(_snap(kv_tokens=24580, block_size=16), "m")
    assert ('vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
            'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="1536"} 1.0') in text  # whole blocks
    rec = scrape_one(ScrapeTarget("r1", "http://x/metrics", "sim", None), _Fetch(text), 1.0, NOW)
    assert rec.ok and rec.kv_tokens == 1536 * 16 and isinstance(rec.kv_tokens, int)
    assert rec.running == 1.0  # the rest as before
    # llama.cpp's personality says nothing of it, as llama-server does not.
    quiet = scrape_one(ScrapeTarget("r1", "http://x/metrics", "llamacpp", None),
                       _Fetch(render_llamacpp(_snap(kv_tokens=24580))), 1.0, NOW)
    assert quiet.ok and quiet.kv_tokens is None


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_running_sims_metrics_say_its_budget_in_its_own_blocks(prefix_caching):
    from simengine.core import SimConfig
    from simengine.engine import ServerOptions, SimApp

    app = SimApp(ServerOptions("127.0.0.1", 0, ("m",), core=SimConfig(kv_tokens=4096), block_size=32,
                               prefix_caching=prefix_caching))
    try:
        text = app.metrics_text()
    finally:
        app.engine.stop()
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    assert 'num_gpu_blocks="128"' in line and 'block_size="32"' in line and f'enable_prefix_caching="{prefix_caching}"' in line
