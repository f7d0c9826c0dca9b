"""The gateway's settings (`LLMGW_GATEWAY_*`), read once at start-up; see docs/gateway.md.

`GatewaySettings` is what a gateway process reads (Redis from the shared `llmgw.settings.Settings`),
with the router's knobs grouped in `RoutingConfig` (what `choose` and `admit` need; unit tests build
their own), whose cost-model coefficients are declared apart in `RoutingTuning` (tuning, not settings:
change one only with a benchmark that shows why). `GunicornSettings` is what `gateway/gunicorn_conf.py` reads. Bad values raise
`ConfigError(variable, reason)` at start-up, never later on the request path.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field, model_validator

from llmgw.errors import ConfigError
from llmgw.settings import EnvSettings, Seconds, Settings, env
from llmgw.state.keypolicy import Priority

Policy = Literal["llmgw", "round_robin", "least_inflight"]
Fairness = Literal["tokens", "fcfs"]
AuthMode = Literal["auto", "required", "off"]
AUTH_MODES: tuple[str, ...] = typing.get_args(AuthMode)


class RoutingTuning(EnvSettings):
    """The cost model's coefficients: how `choose` weighs what it knows, not what a deployment is.

    Tuning, not settings: each default was chosen on the routing benchmarks (docs/history.md has the
    runs), and a change is worth making only with a benchmark that shows why (`python -m bench.fleetsim
    --set FIELD=VALUE`, `python -m bench.prefix`). `RoutingConfig` inherits these fields, so the request
    path reads them as flat attributes of the one config object; docs/gateway.md lists them in a table
    of their own.
    """

    docs: ClassVar[str] = "docs/gateway.md"

    # Scores within this fraction of the best are near-ties, picked at random (spreads gateways).
    tie_tolerance: float = env("LLMGW_GATEWAY_TIE_TOLERANCE", default=0.05, ge=0, le=10,
                               meaning="near-tie band for the random pick")
    # Bounded-load affinity: a session sticks to its endpoint while that endpoint's load is at most
    # this factor times the mean load of its tier (plus one request).
    affinity_load_factor: float = env("LLMGW_GATEWAY_AFFINITY_LOAD_FACTOR", default=1.5, ge=1,
                                      meaning="bounded load for session affinity")
    # A prompt no endpoint was sent yet goes, by rendezvous hashing of its head, to one of the
    # endpoints whose cost is within this factor of the best: wider, more gateways agree on a new
    # system prompt's replica; narrower, a long new prompt waits less behind others' prefills
    # (`python -m bench.prefix` compares the two; docs/history.md has the runs that chose 1.1).
    placement_band: float = env("LLMGW_GATEWAY_PLACEMENT_BAND", default=1.1, ge=1,
                                meaning="cost band for placing a prompt no endpoint holds")
    # What a prefix-cache miss evicts: the prompt it writes into the engine's cache pushes out as many
    # tokens of cached prompts, worth what that cache saved lately. So a miss is charged its prefill
    # again, times this weight times the share of prompt tokens the engine served from its cache (0:
    # only its own prefill; traffic that shares nothing is not charged). Keeps a conversation on the
    # engine that holds it and a system prompt on few engines, whose caches then hold more prompts.
    evict_weight: float = env("LLMGW_GATEWAY_EVICT_WEIGHT", default=1.0, ge=0,
                              meaning="prefill a miss is charged again, times the engine's cache hit share, for what it evicts")
    # A standard request waits in the gateway for a full but faster endpoint only when the expected
    # completion by waiting, times this margin, still beats the best open endpoint (holding a request
    # costs its time to first token for certain; the gain is an estimate).
    wait_margin: float = env("LLMGW_GATEWAY_WAIT_MARGIN", default=2.0, ge=1,
                             meaning="how many times better waiting for a full, faster endpoint must be than "
                                     "sending to an open one")
    # How much of the slowdown a request adds to the sequences already running on an endpoint counts
    # against sending it there (0: each request only minds its own completion; 1: the whole cost).
    imposed_weight: float = env("LLMGW_GATEWAY_IMPOSED_WEIGHT", default=1.0, ge=0,
                                meaning="how much the slowdown a request adds to the sequences already running "
                                        "counts in the score (0: none)")
    # How much KV-cache pressure stretches an endpoint's score (score * (1 + w * kv)).
    kv_weight: float = env("LLMGW_GATEWAY_KV_WEIGHT", default=0.5, ge=0, meaning="score x (1 + w x KV usage)")
    # A learned speed relaxes toward the fleet's best with this half-life (seconds) when the
    # endpoint gets no samples, so an endpoint that was slow once is tried again.
    forget_half_life: Seconds = env("LLMGW_GATEWAY_FORGET_HALF_LIFE", default=60.0, ge=0.01,
                                    meaning="seconds for a slow estimate to relax toward the best while the "
                                            "endpoint gets no samples")
    # The weight of a speed sample (scrape or answer) halves every this many seconds: how fast the
    # learned speed follows an engine that changes, against how much noise it averages out.
    learn_half_life: Seconds = env("LLMGW_GATEWAY_LEARN_HALF_LIFE", default=10.0, ge=0.01,
                                   meaning="seconds after which a speed sample weighs half: how fast the learned "
                                           "speed follows a changing engine")


class RoutingConfig(RoutingTuning):
    """What `choose` and `admit` need: the settings a deployment sets, and (inherited, flat on the same
    object) the cost model's coefficients of `RoutingTuning`."""

    docs: ClassVar[str] = "docs/gateway.md"

    # A benchmark baseline switch, not a setting for a deployment: `round_robin` and `least_inflight`
    # stand for peers' routers in the benchmarks (no speed, no saturation, no admission).
    policy: Policy = env("LLMGW_GATEWAY_POLICY", default="llmgw",
                         meaning="`llmgw`, or the benchmark baselines `round_robin`, `least_inflight`")
    # An endpoint is saturated when its engine reports this many waiting requests ...
    # At least 1: at 0 every endpoint would be saturated, waiting or not, and nothing routed.
    max_waiting: float = env("LLMGW_GATEWAY_MAX_WAITING", default=5, ge=1,
                             meaning="engine-reported waiting requests that make an endpoint saturated (at least 1)")
    # ... or this KV-cache usage (0..1), or when the gateway's in-flight count reaches its capacity.
    max_kv: float = env("LLMGW_GATEWAY_MAX_KV", default=0.8, ge=0, le=1,
                        meaning="engine-reported KV-cache usage (0..1) that makes an endpoint saturated")
    # LoadRecords older than this (seconds), or with ok=False, are ignored.
    stale_after: Seconds = env("LLMGW_GATEWAY_STALE_AFTER", default=3.0, ge=0.01,
                               meaning="seconds (gateway clock) without a new LoadRecord `ts` after which it is ignored")
    # Prefill seconds per prompt token assumed when routing by prefix match (gateway.routing.prefixkeys)
    # until an endpoint's own rate is learned from its engine's counters: what a cached token saves,
    # and what an uncached one costs the request and the batch it joins. A GPU replica of a 7-8B model
    # prefills ~5-20k tokens/s (0.05-0.2 ms); a CPU llama.cpp far slower. 0 turns the prefix term off.
    prefill_ms_per_token: float = env("LLMGW_GATEWAY_PREFILL_MS_PER_TOKEN", default=0.1, ge=0,
                                      meaning="milliseconds of prefill per prompt token, for the prefix-cache "
                                              "term of the score (0: prefix matches are ignored)")
    # An endpoint that refused a connection is passed over for this long (seconds) while its peers
    # can serve, instead of costing a retry on every request until the publisher drops it.
    eject_for: Seconds = env("LLMGW_GATEWAY_EJECT_FOR", default=5.0, ge=0,
                             meaning="seconds an endpoint that refused a connection is passed over while its peers can serve (0: never)")
    # Latency targets (llmgw.slo): a request whose first byte (else whole answer) has more than
    # `slo_lax` seconds to spare on the endpoints that meet its targets is lax, and does not take the
    # model's last `slo_reserve` free slots: it waits in the gateway's queue, where it still has time,
    # and a request with a tight target that arrives meanwhile finds a slot free.
    slo_reserve: float = env("LLMGW_GATEWAY_SLO_RESERVE", default=1, ge=0,
                             meaning="free slots of a model a request with lax latency targets leaves to "
                                     "requests with tight ones (0: none)")
    slo_lax: Seconds = env("LLMGW_GATEWAY_SLO_LAX", default=2.0, ge=0,
                           meaning="seconds to spare on its targets past which a request is lax (leaves the "
                                   "reserved slots, LLMGW_GATEWAY_SLO_RESERVE)")


class GatewaySettings(Settings):
    """Everything one gateway process reads."""

    docs: ClassVar[str] = "docs/gateway.md"

    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    max_body_bytes: int = env("LLMGW_GATEWAY_MAX_BODY_BYTES", default=10 * 1024 * 1024, ge=1,
                              meaning="larger request bodies get 413")
    connect_timeout: Seconds = env("LLMGW_GATEWAY_CONNECT_TIMEOUT", default=2.0, ge=0.001,
                                   meaning="seconds to connect to an engine")
    first_byte_timeout: Seconds = env("LLMGW_GATEWAY_FIRST_BYTE_TIMEOUT", default=120.0, ge=0.001,
                                      meaning="seconds to an engine's first byte; also the longest silence before a "
                                              "stream's first piece (after it: LLMGW_GATEWAY_STALL_TIMEOUT)")
    total_timeout: Seconds = env("LLMGW_GATEWAY_TOTAL_TIMEOUT", default=600.0, ge=0.001,
                                 meaning="seconds a whole answer may take (checked between chunks)")
    retries: int = env("LLMGW_GATEWAY_RETRIES", default=2, ge=0, le=10,
                       meaning="further endpoints tried after a connect error / 5xx / 429 before any byte")
    # After the first byte: an answer whose engine breaks off (dies, hangs, closes the stream, sends an
    # error) goes on from another replica (gateway.http.resume), at most this many times per request,
    # so one request that kills engines cannot take the whole fleet down with it.
    resumes: int = env("LLMGW_GATEWAY_RESUMES", default=2, ge=0, le=10,
                       meaning="times one answer may move to another replica after its engine broke off mid-answer "
                               "(0: never; the stream then ends with an error event)")
    stall_timeout: Seconds = env("LLMGW_GATEWAY_STALL_TIMEOUT", default=30.0, ge=0,
                                 meaning="seconds without a piece of a stream, once its first token came, after which "
                                         "its engine counts as hung and the stream resumes elsewhere (0: only "
                                         "LLMGW_GATEWAY_FIRST_BYTE_TIMEOUT)")
    # The per-model queue standard requests wait in when every endpoint is saturated. An LLM answer
    # takes seconds, so a burst is absorbed by tens of seconds of waiting (under a client's usual 60 s
    # timeout), not refused; each waiting request holds only its body. Requests the queue cannot
    # serve within the bound are refused at once (gateway.routing.admission).
    queue_max: int = env("LLMGW_GATEWAY_QUEUE_MAX", default=1000, ge=0,
                         meaning="per-model queue of standard requests while every endpoint is saturated")
    queue_timeout: Seconds = env("LLMGW_GATEWAY_QUEUE_TIMEOUT", default=30.0, ge=0,
                                 meaning="the longest a standard request waits in that queue (seconds); refused "
                                         "at once when its estimated wait exceeds it")
    restart_hold: Seconds = env("LLMGW_GATEWAY_RESTART_HOLD", default=20.0, ge=0,
                                meaning="the longest a request for a model that had a replica lately, and has none it "
                                        "can reach now (every one failed it, or none is listed: a replica "
                                        "restarting), waits in the model's queue for one to come back (seconds); 0: "
                                        "refused at once")
    # Who of the requests waiting for a saturated model goes next (gateway.routing.fairness): the key
    # that received the least service, counted in tokens over its weight (`tokens`, the Virtual Token
    # Counter), or the oldest request (`fcfs`). Shared by the gateways every LLMGW_GATEWAY_SHARE_FAIRNESS.
    fairness: Fairness = env("LLMGW_GATEWAY_FAIRNESS", default="tokens",
                             meaning="order of a saturated model's queue: `tokens` (the least served key first, "
                                     "by tokens over its weight) or `fcfs` (first come, first served)")
    fair_output_weight: float = env("LLMGW_GATEWAY_FAIR_OUTPUT_WEIGHT", default=2.0, ge=0, le=100,
                                    meaning="what a generated token counts in a key's service, a computed prompt "
                                            "token counting 1 (VTC's weights)")
    share_fairness: Seconds = env("LLMGW_GATEWAY_SHARE_FAIRNESS", default=0.05, ge=0, le=10,
                                  meaning="seconds between a worker's exchanges of the keys' service counters with "
                                          "Redis, for the other gateways and workers (0: counted alone)")
    # Eviction (gateway.routing.eviction): a waiting request that outranks a running answer takes its
    # slot now; the answer pauses and resumes word for word when a slot frees (gateway.http.resume).
    evict: bool = env("LLMGW_GATEWAY_EVICT", default=True,
                      meaning="a waiting request that outranks a running answer (a higher class; interactive over "
                              "a batch line; a key behind on its fair share) evicts it; the answer pauses and "
                              "resumes word for word (0: never)")
    evict_margin: float = env("LLMGW_GATEWAY_EVICT_MARGIN", default=0.5, ge=0, le=1000,
                              meaning="in the same class, how far a waiting key's fair-share counter must be behind "
                                      "the running key's to evict, in requests of the waiting key")
    evict_min_run: Seconds = env("LLMGW_GATEWAY_EVICT_MIN_RUN", default=0.25, ge=0,
                                 meaning="seconds an answer runs on its replica before it may be evicted")
    evict_max: int = env("LLMGW_GATEWAY_EVICT_MAX", default=2, ge=0, le=100,
                         meaning="times one answer may be evicted (then it runs to its end)")
    # ... across gateways (gateway.routing.remote_eviction): a request that finds only other gateways'
    # answers to evict asks them through Redis; each worker looks this often while it asks or runs answers.
    evict_remote: Seconds = env("LLMGW_GATEWAY_EVICT_REMOTE", default=0.02, ge=0, le=10,
                                meaning="seconds between a worker's looks at the other gateways' eviction asks and "
                                        "its own, while it asks or runs answers and another gateway shares "
                                        "(0: a gateway evicts only its own answers)")
    # Latency targets in the queue (gateway.routing.ledger.Backlog.head): a waiter with less than this many
    # seconds of slack goes first, the least slack first; fair share decides while every waiter has more.
    slo_urgent: Seconds = env("LLMGW_GATEWAY_SLO_URGENT", default=1.0, ge=0,
                              meaning="seconds of slack on its first-byte target under which a waiting request goes "
                                      "first, least slack first (fair share decides while all have more)")
    # ... and in eviction (gateway.routing.eviction.outranks): a request that would miss its first-byte
    # target evicts a running answer (of its class or below) with at least this much slack on its own.
    evict_slack: Seconds = env("LLMGW_GATEWAY_EVICT_SLACK", default=5.0, ge=0,
                               meaning="seconds of slack a running answer keeps on its targets for a request that "
                                       "would miss its first-byte target to evict it (no targets: any)")
    pause_keepalive: Seconds = env("LLMGW_GATEWAY_PAUSE_KEEPALIVE", default=5.0, ge=0.1,
                                   meaning="seconds between the SSE comment lines a paused stream sends while it waits "
                                           "for a slot, so proxies with idle timeouts keep it open")
    default_priority: Priority = env("LLMGW_GATEWAY_DEFAULT_PRIORITY", default="standard",
                                     meaning="for requests without X-LLMGW-Priority and without a key default")
    poll_interval: Seconds = env("LLMGW_GATEWAY_POLL_INTERVAL", default=0.5, ge=0.01,
                                 meaning="seconds between reads of the endpoint list's version")
    load_interval: Seconds = env("LLMGW_GATEWAY_LOAD_INTERVAL", default=0.5, ge=0.01,
                                 meaning="seconds between reads of the endpoints' load")
    keys_interval: Seconds = env("LLMGW_GATEWAY_KEYS_INTERVAL", default=2.0, ge=0.01,
                                 meaning="seconds between reads of the API key table")
    usage_flush: Seconds = env("LLMGW_GATEWAY_USAGE_FLUSH", default=0.5, ge=0.01,
                               meaning="usage counters are batched in memory and flushed this often (seconds)")
    redis_timeout: Seconds = env("LLMGW_GATEWAY_REDIS_TIMEOUT", default=0.25, ge=0.001,
                                 meaning="socket timeout of the request-path Redis client (rate limits)")
    seed: int | None = env("LLMGW_GATEWAY_SEED", default=None,
                           meaning="seeds the router's randomness (benchmarks and tests); unset = random")
    upstream_pool: int = env("LLMGW_GATEWAY_UPSTREAM_POOL", default=256, ge=1,
                             meaning="idle keep-alive connections kept per endpoint")
    max_connections: int | None = env(
        "LLMGW_GATEWAY_MAX_CONNECTIONS", default=None, ge=1,
        meaning="requests one process holds open at once (parsed, queued or streaming); the next get 503 with "
                "Retry-After. Unset: 10,000, or fewer if the file-descriptor limit allows fewer")
    # A conversation's turns reach different gateways behind an L4 load balancer: each worker flushes
    # what it sent where to Redis this often, and reads the other gateways' flushes as they land
    # (gateway.server.sendshare), so a later turn finds its history whichever gateway takes it. Off
    # the request path; 0 turns it off.
    share_sends: Seconds = env("LLMGW_GATEWAY_SHARE_SENDS", default=0.05, ge=0, le=10,
                               meaning="seconds between a worker's flushes of what it sent where (prompt block keys) "
                                       "to Redis, for the other gateways (0: not shared)")
    report_interval: Seconds = env("LLMGW_GATEWAY_REPORT_INTERVAL", default=0.5, ge=0.01,
                                   meaning="seconds between this process's gateway reports (in flight, demand, "
                                           "the endpoint list it routes by; docs/lifecycle.md)")
    start_wait: Seconds = env("LLMGW_GATEWAY_START_WAIT", default=10.0, ge=0,
                              meaning="seconds a starting worker waits for the endpoint list and the key table "
                                      "before it accepts requests anyway (answering 503s that say why)")
    auth: AuthMode = env("LLMGW_GATEWAY_AUTH", default="auto",
                         meaning="`auto` (a key is required once any key exists), `required`, `off`; except with "
                                 "`off`, nothing is served until the key table was read once")

# Open requests per process when LLMGW_GATEWAY_MAX_CONNECTIONS is unset: 10,000 streams take about
# 20,000 file descriptors and well under 1 GiB (`python -m bench.streams` prints the RSS).
DEFAULT_MAX_CONNECTIONS = 10_000

def _readable(path: Path) -> Path:
    """A TLS file gunicorn will open: checked at start-up, so a typo is one line naming the variable."""
    path = path.expanduser().absolute()
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    return path


class GunicornSettings(EnvSettings):
    """What gateway/gunicorn_conf.py reads (command-line flags still override it)."""

    docs: ClassVar[str] = "docs/gateway.md"

    workers: int = env("LLMGW_GATEWAY_WORKERS", default_factory=lambda: os.cpu_count() or 1, ge=1,
                       meaning="gunicorn worker processes (gevent: each holds thousands of open streams); "
                               "default: the machine's cores")
    bind: str | None = env("LLMGW_GATEWAY_BIND", default=None,
                           meaning="listen address; unset: `127.0.0.1:$PORT`; compose sets `0.0.0.0:8080`")
    port: int = env("PORT", default=8080, ge=0, le=65535, meaning="the port of the default listen address")
    backlog: int = env("LLMGW_GATEWAY_BACKLOG", default=65535, ge=64, le=1 << 20,
                       meaning="connections the kernel keeps waiting to be accepted (the listen queue); the "
                               "kernel caps it at net.core.somaxconn, which the gateway logs at start when lower")
    certfile: Annotated[Path, AfterValidator(_readable)] | None = env(
        "LLMGW_GATEWAY_CERTFILE", default=None,
        meaning="PEM certificate (chain) file: with the key file, gunicorn serves HTTPS; unset: plain HTTP")
    keyfile: Annotated[Path, AfterValidator(_readable)] | None = env(
        "LLMGW_GATEWAY_KEYFILE", default=None, meaning="PEM private key of that certificate")

    @model_validator(mode="after")
    def _tls_needs_both(self) -> "GunicornSettings":
        if (self.certfile is None) != (self.keyfile is None):
            missing = "LLMGW_GATEWAY_KEYFILE" if self.keyfile is None else "LLMGW_GATEWAY_CERTFILE"
            other = "LLMGW_GATEWAY_CERTFILE" if self.keyfile is None else "LLMGW_GATEWAY_KEYFILE"
            raise ConfigError(missing, f"HTTPS needs it too ({other} is set)")
        return self

    @property
    def address(self) -> str:
        return self.bind or f"127.0.0.1:{self.port}"

    @property
    def scheme(self) -> str:
        return "https" if self.certfile else "http"
