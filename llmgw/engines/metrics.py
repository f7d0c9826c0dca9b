"""Map an engine's scraped /metrics text to llmgw's load numbers.

`read_load(text, engine, profile)` applies the profile's effective mapping (the seed's rule, in
`EngineDriver.effective_metrics`), the engine's KV fallbacks and its token counters. A series that
is unmapped or absent is None (unknown), never 0: the router must not mistake "not reported" for
"idle". Several label sets of one series (vLLM labels by model_name and engine; data parallelism
gives one per engine) are summed, except the KV ratio, which is averaged.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from llmgw.catalog.types import Profile
from llmgw.engines.base import EngineDriver
from llmgw.errors import LlmgwError


class MetricsMalformed(LlmgwError, ValueError):
    """The /metrics body is not Prometheus text (an HTML error page, a truncated line, ...)."""

    def __init__(self, reason: str, line: str | None = None):
        self.reason, self.line = reason, line
        where = f" (near: {line[:120]!r})" if line else ""
        super().__init__(f"malformed metrics text: {reason}{where}")


@dataclass(frozen=True)
class MappedLoad:
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    prefix_queries_total: float | None = None  # prompt tokens looked up in the prefix cache
    prefix_hits_total: float | None = None  # of them found there
    prefill_seconds_total: float | None = None  # seconds spent prefilling
    prefill_tokens_total: float | None = None  # prompt tokens computed in them, where counted apart
    kv_tokens: int | None = None  # the KV cache's size in tokens, where the engine says it


def parse_samples(text: str) -> dict[str, list[float]]:
    """Every sample's value by sample name (`x_total`, `x_bucket`, ... as written), NaN dropped."""
    out: dict[str, list[float]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not math.isnan(s.value):
                    out[s.name].append(float(s.value))
    except ValueError as e:
        raise MetricsMalformed(str(e), _first_bad_line(text)) from e
    return dict(out)


def _first_bad_line(text: str) -> str | None:
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            try:
                list(text_string_to_metric_families(line + "\n"))
            except ValueError:
                return line
    return None


def _values(samples: dict[str, list[float]], name: str | None) -> list[float] | None:
    """Samples of `name`; a counter may be named with or without `_total` (prometheus_client adds
    `_total` to every counter's sample, even llama.cpp's `n_tokens_max`)."""
    if not name:
        return None
    for candidate in (name, name + "_total", name.removesuffix("_total")):
        if candidate in samples:
            return samples[candidate]
    return None


def _sum(values: list[float] | None) -> float | None:
    return math.fsum(values) if values else None


def _mean(values: list[float] | None) -> float | None:
    return math.fsum(values) / len(values) if values else None


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def read_kv_tokens(metrics_text: str, name: str | None) -> int | None:
    """The KV cache's size in tokens from an info series such as vLLM's `vllm:cache_config_info`
    (labels `num_gpu_blocks` and `block_size`; value 1), summed over its `engine` label sets (data
    parallelism: one cache per engine). None when the series is absent or its blocks are not known
    yet (vLLM writes "None" until its cache is allocated). A line scan, not a parse: the series is
    one line in a body of histograms, read on every scrape."""
    if not name:
        return None
    total, head = 0, name + "{"
    for line in metrics_text.splitlines():
        if not line.startswith(head):
            continue
        labels = dict(_LABEL.findall(line[len(head):line.rfind("}")]))
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if not (blocks.isdigit() and size.isdigit()) or int(blocks) * int(size) < 1:
            return None  # one engine's cache not known yet: the sum would be too small
        total += int(blocks) * int(size)
    return total or None


def read_load(metrics_text: str, engine: EngineDriver, profile: Profile) -> MappedLoad:
    """The load numbers of one replica from its /metrics text. Raises MetricsMalformed."""
    samples = parse_samples(metrics_text)
    mapping = engine.effective_metrics(profile)
    kv = _values(samples, mapping.kv_usage)
    # Fallbacks only stand in for the engine's own default name (vLLM renamed its KV gauge in
    # 0.9.2); a name the operator chose is taken as meant.
    if kv is None and mapping.kv_usage and mapping.kv_usage == engine.default_metrics.kv_usage:
        for fallback in engine.kv_fallbacks:
            kv = _values(samples, fallback)
            if kv is not None:
                break
    prompt_name, gen_name = engine.token_metrics(profile)
    queries_name, hits_name, prefill_name, computed_name = engine.cache_metrics(profile)
    return MappedLoad(
        running=_sum(_values(samples, mapping.running)),
        waiting=_sum(_values(samples, mapping.waiting)),
        kv_usage=_mean(kv),
        prompt_tokens_total=_sum(_values(samples, prompt_name)),
        generation_tokens_total=_sum(_values(samples, gen_name)),
        prefix_queries_total=_sum(_values(samples, queries_name)),
        prefix_hits_total=_sum(_values(samples, hits_name)),
        prefill_seconds_total=_sum(_values(samples, prefill_name)),
        prefill_tokens_total=_sum(_values(samples, computed_name)),
        kv_tokens=read_kv_tokens(metrics_text, engine.kv_config_metric),
    )
