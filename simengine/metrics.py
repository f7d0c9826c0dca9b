"""The simulated engine's /metrics text, in vLLM's names (default) or llama.cpp's.

vLLM's text comes from prometheus_client (as vLLM's own does), labelled by `model_name` and
`engine`. llama.cpp's is written by hand in the exact shape llama-server writes it: unlabelled,
`llamacpp:` prefix, counters before gauges, no KV series (like current builds).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# vLLM's bucket edges for vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    edges: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.edges) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.edges, v)] += 1
        self.total += v
        self.n += 1

    def copy(self) -> "Histogram":
        h = Histogram(self.edges)
        h.counts, h.total, h.n = list(self.counts), self.total, self.n
        return h

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for edge, c in zip(self.edges, self.counts):
            acc += c
            out.append((repr(float(edge)), acc))
        out.append(("+Inf", self.n))
        return out


@dataclass(frozen=True)
class Snapshot:
    """Everything /metrics reports, read under the engine lock."""

    running: int
    waiting: int
    kv_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    success_total: dict[str, int]  # finished_reason -> count
    ttft: Histogram
    e2e: Histogram
    started: float  # wall-clock time the counters were created
    busy_seconds_prompt: float = 0.0
    busy_seconds_decode: float = 0.0
    n_decode_total: int = 0
    max_seq_tokens: int = 0
    prompt_cached_total: int = 0  # prompt tokens found computed (a prefix-cache hit, a slot's reuse)
    prefix_queries: int = 0  # vLLM's prefix cache: prompt tokens looked up, and found
    prefix_hits: int = 0
    # vllm:lora_requests_info's series: (labels, value) each; empty without --enable-lora.
    lora_info: tuple[tuple[dict, float], ...] = ()
    kv_tokens: int = 0  # the KV budget, for vllm:cache_config_info (0: not reported)
    block_size: int = 16
    prefix_caching: bool = True


class _VllmCollector:
    def __init__(self, snap: Snapshot, model_name: str):
        self.snap, self.model_name = snap, model_name

    def collect(self):
        s, lv = self.snap, [self.model_name, "0"]
        labels = ["model_name", "engine"]
        g = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.", labels=labels)
        g.add_metric(lv, s.running)
        yield g
        g = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=labels)
        g.add_metric(lv, s.waiting)
        yield g
        g = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        g.add_metric(lv, s.kv_usage)
        yield g
        c = CounterMetricFamily("vllm:prompt_tokens", "Number of prefill tokens processed.", labels=labels)
        c.add_metric(lv, s.prompt_tokens_total, created=s.started)
        yield c
        c = CounterMetricFamily("vllm:prefix_cache_queries",
                                "Prefix cache queries, in terms of number of queried tokens.", labels=labels)
        c.add_metric(lv, s.prefix_queries, created=s.started)
        yield c
        c = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                labels=labels)
        c.add_metric(lv, s.prefix_hits, created=s.started)
        yield c
        c = CounterMetricFamily("vllm:generation_tokens", "Number of generation tokens processed.", labels=labels)
        c.add_metric(lv, s.generation_tokens_total, created=s.started)
        yield c
        c = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                labels=[*labels, "finished_reason"])
        for reason in ("stop", "length", "abort", "error", "repetition"):  # vLLM 0.32's label sets
            c.add_metric([*lv, reason], s.success_total.get(reason, 0), created=s.started)
        yield c
        h = HistogramMetricFamily("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels=labels)
        h.add_metric(lv, s.ttft.cumulative(), s.ttft.total)
        yield h
        h = HistogramMetricFamily("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels=labels)
        h.add_metric(lv, s.e2e.cumulative(), s.e2e.total)
        yield h
        # The engine's prefill time (its steps' prefill share, summed): the sum is what a router reads
        # as seconds per computed prompt token; the buckets are not modelled (only +Inf).
        h = HistogramMetricFamily("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase "
                                  "for request.", labels=labels)
        h.add_metric(lv, [("+Inf", s.ttft.n)], s.busy_seconds_prompt)
        yield h
        # The prompt tokens that prefill computed (not found cached), counted with its seconds: vLLM
        # observes both as a request ends; here both as the step that computed them ends.
        h = HistogramMetricFamily("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
                                  "computed during prefill (excluding cached tokens).", labels=labels)
        h.add_metric(lv, [("+Inf", s.ttft.n)], s.prompt_tokens_total - s.prompt_cached_total)
        yield h
        if s.kv_tokens:
            # vLLM's info gauge of its CacheConfig (a subset of its labels, as strings, value 1), with
            # the `engine` label only: whole blocks, as vLLM allocates them.
            names = ["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                     "num_cpu_blocks", "num_gpu_blocks", "engine"]
            g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=names)
            g.add_metric([str(s.block_size), "auto", str(s.prefix_caching), "0.9", "None",
                          str(s.kv_tokens // s.block_size), "0"], 1.0)
            yield g
        if s.lora_info:
            names = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
            g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.", labels=names)
            for found, value in s.lora_info:
                g.add_metric([found[n] for n in names], value)
            yield g


def render_vllm(snap: Snapshot, model_name: str) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_VllmCollector(snap, model_name))
    return generate_latest(registry).decode()


def _num(v: float) -> str:
    # llama-server prints doubles with C++ ostream defaults (6 significant digits).
    return f"{float(v):g}"


def render_llamacpp(snap: Snapshot) -> str:
    """The text llama-server (0.6.0-dev, 2025) writes: counters, then gauges, HELP/TYPE for each."""
    processed = snap.prompt_tokens_total - snap.prompt_cached_total
    prompt_tps = processed / snap.busy_seconds_prompt if snap.busy_seconds_prompt else 0.0
    gen_tps = snap.generation_tokens_total / snap.busy_seconds_decode if snap.busy_seconds_decode else 0.0
    busy_per_decode = snap.generation_tokens_total / snap.n_decode_total if snap.n_decode_total else 0.0
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", processed),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", snap.prompt_cached_total),
        ("prompt_seconds_total", "Total time spent processing prompts", snap.busy_seconds_prompt),
        ("tokens_predicted_total", "Number of generation tokens processed", snap.generation_tokens_total),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", snap.busy_seconds_decode),
        ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and "
                           "multimodal decoding", snap.n_decode_total),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", snap.max_seq_tokens),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", 0),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", 0),
    ]
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_tps),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", gen_tps),
        ("requests_processing", "Number of requests processing", snap.running),
        ("requests_deferred", "Number of requests deferred", snap.waiting),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", busy_per_decode),
    ]
    lines = []
    for kind, rows in (("counter", counters), ("gauge", gauges)):
        for name, help_, value in rows:
            lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {_num(value)}"]
    return "\n".join(lines) + "\n"


class MetricsState:
    """Counters and histograms the server keeps beside the core (guarded by the engine's lock)."""

    def __init__(self, started: float):
        self.started = started
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.success: dict[str, int] = {}
        self.busy_prompt = 0.0
        self.busy_decode = 0.0
        self.n_decode = 0
