"""The gateway's Prometheus metrics, in a registry per app (factories, not module globals).

Under gunicorn with several workers set PROMETHEUS_MULTIPROC_DIR: the metrics are then written to
that directory by every worker and `/metrics` aggregates them (gauges use live-sum / live-max modes).
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.multiproc = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # In multiprocess mode the values live in files; the registry we render is built per scrape.
        reg = None if self.multiproc else CollectorRegistry()
        kw = {"registry": reg}  # None: not registered; multiprocess values still go to the files
        self.registry = reg
        self._children: dict = {}
        self.requests = Counter("llmgw_gateway_requests", "Requests by model, endpoint and status",
                                ["model", "endpoint", "status"], **kw)
        self.latency = Histogram("llmgw_gateway_request_seconds", "Request latency (to the last byte)",
                                 ["model"], buckets=LATENCY_BUCKETS, **kw)
        self.ttft = Histogram("llmgw_gateway_ttft_seconds", "Time to the first byte from the engine",
                              ["model"], buckets=LATENCY_BUCKETS, **kw)
        self.tokens = Counter("llmgw_gateway_tokens", "Tokens by model and direction (prompt|completion)",
                              ["model", "kind"], **kw)
        self.inflight = Gauge("llmgw_gateway_inflight", "Requests in flight per endpoint", ["endpoint"],
                              multiprocess_mode="livesum", **kw)
        self.queue = Gauge("llmgw_gateway_queue_length", "Requests waiting in the per-model queue", ["model"],
                           multiprocess_mode="livesum", **kw)
        self.shed = Counter("llmgw_gateway_shed", "Requests rejected by admission or rate limits",
                            ["model", "reason"], **kw)
        self.client_gone = Counter("llmgw_gateway_client_gone", "Requests whose client closed its connection "
                                   "before the answer began (queued: left the queue, never sent; answering: "
                                   "the engine's connection closed, so it aborts)", ["model", "phase"], **kw)
        self.denied = Counter("llmgw_gateway_denied", "Requests an API key's policy refused, by reason "
                              "(key_expired, model_not_found, budget_exceeded)", ["reason"], **kw)
        self.rejected_unknown = Counter("llmgw_gateway_unknown_model", "Requests for a model name nobody knows "
                                        "(one series: unknown names never become labels)", **kw)
        self.over_capacity = Counter("llmgw_gateway_over_capacity", "Requests refused with 503 because the "
                                     "process held LLMGW_GATEWAY_MAX_CONNECTIONS open requests", **kw)
        self.retries = Counter("llmgw_gateway_retries", "Retries on another endpoint", ["model"], **kw)
        self.upstream_errors = Counter("llmgw_gateway_upstream_errors", "Upstream failures by endpoint and kind",
                                       ["endpoint", "kind"], **kw)
        self.stream_resumes = Counter("llmgw_gateway_stream_resumes", "Answers whose engine broke off after the "
                                      "first byte, by model, cause (reset, closed, stall, engine_error) and outcome "
                                      "(resumed, retried, finished, cut)", ["model", "reason", "outcome"], **kw)
        # Eviction (gateway.routing.eviction): answers paused for a waiting request that outranked them,
        # how long streams paused for a slot (evicted or broken off), what their continuations read again.
        self.evictions = Counter("llmgw_gateway_evictions", "Running answers evicted for a waiting request that "
                                 "outranked them (each pauses and resumes word for word), by model", ["model"], **kw)
        self.pause_seconds = Histogram("llmgw_gateway_pause_seconds", "Seconds a stream paused between its eviction "
                                       "(or its engine's break) and the slot its continuation got", ["model"],
                                       buckets=LATENCY_BUCKETS, **kw)
        self.evicted_tokens = Counter("llmgw_gateway_evicted_tokens", "Tokens of evicted answers that their "
                                      "continuation's prefill reads again", ["model"], **kw)
        self.resume_prefill = Counter("llmgw_gateway_resume_prefill_tokens", "Prompt tokens of continuations (after "
                                      "an eviction or a break), by whether the engine served them from its prefix "
                                      "cache (cached) or computed them (computed), as its usage reported",
                                      ["model", "kind"], **kw)
        # Prefix-cache routing (gateway.routing.prefixkeys): what the gateway expected each endpoint to
        # hold of the prompts it sent there, and the prefill it expected that to save; the engines'
        # own counters (vllm:prefix_cache_hits, llama.cpp timings.cache_n) say what they kept.
        self.prefix_prompt = Counter("llmgw_gateway_prefix_prompt_tokens", "Prompt tokens (estimated) of requests "
                                     "routed with block keys, by endpoint", ["endpoint"], **kw)
        self.prefix_predicted = Counter("llmgw_gateway_prefix_predicted_hit_tokens", "Prompt tokens the chosen "
                                        "endpoint was expected to hold in its prefix cache", ["endpoint"], **kw)
        self.prefix_saved = Counter("llmgw_gateway_prefix_saved_seconds", "Prefill seconds the expected prefix "
                                    "hits save (at LLMGW_GATEWAY_PREFILL_MS_PER_TOKEN)", ["endpoint"], **kw)
        self.prefix_measured = Counter("llmgw_gateway_prefix_measured_hit_tokens", "Prompt tokens the engine "
                                       "reported it reused (llama.cpp timings.cache_n)", ["endpoint"], **kw)
        # What this gateway told the other gateways it sent, and learned from them (gateway.server.sendshare).
        self.sends_shared = Counter("llmgw_gateway_sends_shared", "Requests with block keys exchanged with the "
                                    "other gateways through Redis, by direction (published|learned)",
                                    ["direction"], **kw)
        # What the other gateways said they hold per endpoint (gateway.routing.othergateways), as routing counts it.
        # Each worker reads them on its own: the least any worker counts (one that has not heard yet shows).
        self.other_gateways_inflight = Gauge("llmgw_gateway_other_gateways_inflight", "Requests the other gateways "
                                             "said they hold per endpoint, as the least informed worker of this "
                                             "gateway counts them", ["endpoint"], multiprocess_mode="livemin", **kw)
        # Precise prefix routing (gateway.server.kvevents): how far each worker's index of an engine's KV
        # events has got, as the least advanced worker has it (one that has not heard yet shows).
        self.kv_index_batch = Gauge("llmgw_gateway_kv_index_batch", "The number of the last KV event batch of "
                                    "the endpoint's engine folded into the prefix index (-1: none yet), as the "
                                    "least advanced worker of this gateway has it", ["endpoint"],
                                    multiprocess_mode="livemin", **kw)
        self.kv_index_blocks = Gauge("llmgw_gateway_kv_index_blocks", "KV cache blocks the prefix index holds for "
                                     "the endpoint, from its engine's events, as the least informed worker of "
                                     "this gateway counts them", ["endpoint"], multiprocess_mode="livemin", **kw)
        # Fair queueing per API key (gateway.routing.fairness; `key` is the key's name): the service it
        # received in tokens (prompt tokens computed + LLMGW_GATEWAY_FAIR_OUTPUT_WEIGHT x tokens generated),
        # the seconds its requests waited in the queue, its requests sent, and its share of the model's
        # service over the last minute, every gateway's (as read from Redis).
        self.tenant_service = Counter("llmgw_gateway_tenant_service_tokens", "Tokens of service a key's requests "
                                      "received (prompt tokens computed + output weight x tokens generated)",
                                      ["model", "key"], **kw)
        self.tenant_wait = Counter("llmgw_gateway_tenant_queue_wait_seconds", "Seconds a key's requests waited in "
                                   "the gateway's queue of a saturated model", ["model", "key"], **kw)
        self.tenant_requests = Counter("llmgw_gateway_tenant_requests", "Requests of a key sent to the model's "
                                       "engines (the queue wait per request is the ratio of the two)",
                                       ["model", "key"], **kw)
        self.tenant_share = Gauge("llmgw_gateway_tenant_share", "A key's share of the model's service over the "
                                  "last minute, every gateway's", ["model", "key"], multiprocess_mode="livemax", **kw)
        self.endpoints_version = Gauge("llmgw_gateway_endpoints_version", "Version of the endpoint list in use",
                                       multiprocess_mode="livemax", **kw)
        self.endpoints = Gauge("llmgw_gateway_endpoints", "Endpoints in the list in use",
                               multiprocess_mode="livemax", **kw)
        self.redis_unavailable = Gauge("llmgw_gateway_redis_unavailable", "1 while Redis cannot be reached",
                                       multiprocess_mode="livemax", **kw)

    def child(self, metric, *labels):
        """`metric.labels(*labels)`, memoised: prometheus_client's own lookup takes a lock and costs
        ~4 us, seven times per request. Label values here are known models and published endpoint
        ids only, so the memo is as bounded as the metric's own children."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def kv_index(self, endpoint: str, batch: int, blocks: int) -> None:
        """Where this worker's KV index of `endpoint` stands (gateway.server.kvevents, after each batch)."""
        self.child(self.kv_index_batch, endpoint).set(batch)
        self.child(self.kv_index_blocks, endpoint).set(blocks)

    def render(self) -> bytes:
        if self.multiproc:
            from prometheus_client import multiprocess

            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
            return generate_latest(reg)
        return generate_latest(self.registry)
