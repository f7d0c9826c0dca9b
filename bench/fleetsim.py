"""A deterministic fleet simulator for routing: seeded, on a virtual clock, no processes, no sockets.

    python -m bench.fleetsim [--fleets fleet-a,...] [--loads 0.5,0.8,0.95,burst] [--seeds 3]
                             [--policies llmgw,least_inflight,round_robin,power_of_two] [--held-out]
                             [--workload random|conversations|mix] [--make vllm|llamacpp]

Engines are the sim engine's own batching model (`simengine.core.SimCore`: continuous batching,
FIFO wait, decode step `step_ms * (1 + batch_alpha * (running - 1)) / speed`, prefill per prompt
token, one event per token). Every `scrape` seconds each engine's running/waiting/KV/token counters
are written as a LoadRecord (as the agent does), which each gateway reads every `load_interval`
seconds. The gateway is the real code: the `Router` (route, release, what it learns) fed by its
`Pollers` on a fake clock, `choose()`, `admission.decide` and the wait-queue rules of
`gateway.http.proxy`, in the admission shell bench/fairness.py runs too (bench/simshell.py: only the
queue's head routes; it tries again when a request ends or new loads arrive). So a policy can be
tried on a dozen fleets in seconds, without the CPU noise of real processes, and the same seed gives
the same figures.

Peers that are not llmgw code are modelled in `MODELLED`, one instance per gateway process:
`power_of_two` (vLLM router's: two random engines, the one with fewer requests in flight from this
router), `speed_weighted` (least outstanding weighted by nominal speed) and `smg_cache_aware`
(SGLang's gateway, `SmgCacheAware`: a conversation stays where its prefix went, the rest go to the
least loaded). Other bench modules register routers of their own there (bench/oracle.py: routers that
know every engine's exact state, to show how far routing can go).

The default traffic (`--workload random`) has prompts that share nothing. `conversations` and `mix`
are bench/prefix.py's sessions (bench/conversations.py): each turn resends the history over one of
24 shared system prompts, and a turn is sent a think time after the previous answer; the engines
then keep a prefix cache, vLLM's (blocks within the KV budget) or, with `--make llamacpp`, llama.cpp's
slots (one prompt each), and report their loads as that engine's /metrics would (llama.cpp: no KV
gauge, prompt tokens without the cached ones). The table then has the fleet's hit ratio from the
engines' counters (after the warm-up) beside the latencies. In these workloads each turn reaches
llmgw as the gateway gets a streamed chat request: with its prompt's block keys, minimising its first
token; the engines' load records carry what the agent scrapes for prefix routing (vLLM's prefix-cache
counters, the prefill seconds), so the gateway learns each engine's prefill rate and cache as it would.

`--workload prefix` replays bench/prefix.py's own default traffic (80 conversations at 2 a second, a
fifth of the requests one-shot, counted from cold caches) on its fleets, `prefix-bench` (4 identical
engines) or `prefix-uneven`: its figures sit beside that benchmark's, without the noise of real
processes, over as many seeds as asked (`--first-seed K --seeds 1` for one).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from gateway.config import GatewaySettings
from gateway.routing.admission import Queue, Refuse
from gateway.routing.choice import Choice, Slo
from gateway.routing.prefixkeys import opens_conversation, prefix_of
from llmgw.state.keypolicy import Tenant
from llmgw.state.records import EndpointInfo, LoadRecord
from llmgw.state.store import CatalogOutline
from bench import conversations as conv
from bench import traffic
from bench.fleets import (FLEETS, HELD_OUT, LOADS, PREFIX_CONVERSATIONS, PREFIX_LOAD, PREFIX_RATE, Engine, Fleet, Load,
                          prefix_fleets)
from bench.report import pct
from bench.simshell import EventLoop, GatewayShell, Peer, gateway_parts
from simengine.core import SimConfig, SimCore
from simengine.engine import ServerOptions, prompt_cache_tokens
from simengine.prefix import PrefixCache
from simengine.slots import Slots
from llmgw.surface import CHAT
from harness.loadgen import poisson_times

# --- peers modelled --------------------------------------------------------------------------------
class PowerOfTwo:
    """vLLM router's: two random engines, the one with fewer requests in flight from this router."""

    def __init__(self, gw: GatewayShell):
        self.rng = gw.sim.rng
        self.inflight: dict[str, int] = {}

    def choose(self, req: Req, endpoints: Sequence[EndpointInfo]) -> Choice:
        eps = [e for e in endpoints if e.id not in req.exclude] or list(endpoints)
        a, b = self.rng.sample(eps, 2) if len(eps) > 1 else (eps[0], eps[0])
        ia, ib = self.inflight.get(a.id, 0), self.inflight.get(b.id, 0)
        e = a if ia <= ib else b
        self.inflight[e.id] = self.inflight.get(e.id, 0) + 1
        return Choice(e, 0.0, 0, reason="power_of_two")

    def release(self, endpoint_id: str) -> None:
        self.inflight[endpoint_id] -= 1


class SpeedWeighted(PowerOfTwo):
    """The issue's client-side reference: least outstanding weighted by each engine's nominal speed
    (it is told the speeds; no capacity, no learning)."""

    def __init__(self, gw: GatewayShell):
        super().__init__(gw)
        self.speed = {e.name: e.sim.speed for e in gw.sim.fleet.engines}

    def choose(self, req: Req, endpoints: Sequence[EndpointInfo]) -> Choice:
        eps = [e for e in endpoints if e.id not in req.exclude] or list(endpoints)
        e = min(eps, key=lambda e: ((self.inflight.get(e.id, 0) + 1) / self.speed[e.id], self.rng.random()))
        self.inflight[e.id] = self.inflight.get(e.id, 0) + 1
        return Choice(e, 0.0, 0, reason="speed_weighted")


class Picks:
    """A router that picks the endpoint by `pick(gateway, request)` (bench/oracle.py's), named `name`."""

    def __init__(self, gw: GatewayShell, pick: Callable[[GatewayShell, "Req"], EndpointInfo], name: str):
        self.gw, self.pick, self.name = gw, pick, name

    def choose(self, req: Req, endpoints: Sequence[EndpointInfo]) -> Choice:
        return Choice(self.pick(self.gw, req), 0.0, 0, reason=self.name)

    def release(self, endpoint_id: str) -> None:
        pass


class SmgCacheAware:
    """SGLang's gateway, `smg launch --policy cache_aware`, as its source has it (smg's
    model_gateway/src/policies/cache_aware.rs, HTTP mode, the defaults of bindings/python's
    router_args.py): a tree per model of the prompts sent, each node knowing which workers were sent
    it and which last. A request whose longest match covers more than `CACHE_THRESHOLD` of its
    prompt goes to the worker holding that match (the last one sent it, on a tie), any other to the
    worker with the fewest requests in flight from this router (ties: the fewest routed so far,
    then the first); only when the pool is imbalanced (max - min > `BALANCE_ABS` and max >
    `BALANCE_REL` x min, in flight) does every request go to the least loaded. Either way the prompt
    is inserted for the worker chosen. The tree here is of 16-token blocks rather than characters (a
    match falls short by less than a block), and nothing is evicted: smg evicts every 60 s down to
    2^26 characters, more than a run of this simulator sends. The source read is smg's of 2026-08
    (v1.9); the smg 1.13 that bench/prefix.py runs describes its gate (`smg launch --help`) as a
    matched worker skipped when its load exceeds the fleet's mean by the absolute threshold capped
    at two standard deviations (at least 4) and 1.5x the mean: at these loads about 10 in flight on
    one engine, which this model never reaches; a real run moved 1 of 348 later turns
    (bench/prefix.py, seed 7), this model none."""

    CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5
    BLOCK = 16

    def __init__(self) -> None:
        self.sent: dict[int, dict[str, int]] = {}  # a block chain key -> worker -> when last sent (a count)
        self.load: dict[str, int] = {}
        self.processed: dict[str, int] = {}
        self.clock = 0

    def _keys(self, tokens: tuple[int, ...]) -> list[int]:
        keys, h = [], 0
        for i in range(0, len(tokens) - self.BLOCK + 1, self.BLOCK):
            h = hash((h, tokens[i:i + self.BLOCK]))
            keys.append(h)
        return keys

    def choose(self, req: Req, endpoints) -> Choice:
        eps = [e for e in endpoints if e.id not in req.exclude] or list(endpoints)
        loads = [self.load.get(e.id, 0) for e in eps]
        least = min(eps, key=lambda e: (self.load.get(e.id, 0), self.processed.get(e.id, 0)))
        pick, why = least, "smg: least load"
        keys = self._keys(req.tokens) if req.tokens else []
        balanced = not (max(loads) - min(loads) > self.BALANCE_ABS and max(loads) > self.BALANCE_REL * min(loads))
        if balanced and keys:
            ids, depth, owner = {e.id for e in eps}, 0, None
            for k in keys:
                holders = {w: t for w, t in self.sent.get(k, {}).items() if w in ids}
                if not holders:
                    break
                depth, owner = depth + 1, max(holders, key=holders.__getitem__)
            if owner is not None and depth * self.BLOCK / len(req.tokens) > self.CACHE_THRESHOLD:
                pick, why = next(e for e in eps if e.id == owner), "smg: cache hit"
        self.clock += 1
        for k in keys:
            self.sent.setdefault(k, {})[pick.id] = self.clock
        self.load[pick.id] = self.load.get(pick.id, 0) + 1
        self.processed[pick.id] = self.processed.get(pick.id, 0) + 1
        return Choice(pick, 0.0, 0, reason=why)

    def release(self, endpoint_id: str) -> None:
        self.load[endpoint_id] -= 1


# Routers modelled in place of llmgw's (the other policies are llmgw's own, LLMGW_GATEWAY_POLICY): a
# policy's name -> the router of one gateway process, made for it (each has its own counts, as each
# instance of the peer has). Other bench modules add theirs (bench/oracle.py).
MODELLED: dict[str, Callable[[GatewayShell], Peer]] = {
    "power_of_two": PowerOfTwo,
    "speed_weighted": SpeedWeighted,
    "smg_cache_aware": lambda gw: SmgCacheAware(),  # each gateway process its own tree and counts, as each smg has
}
PEERS = tuple(MODELLED)  # the ones modelled here


def modelled(policy: str) -> bool:
    """Whether `policy` is a peer modelled here or elsewhere rather than llmgw's own code."""
    return policy in MODELLED


# --- the simulation ----------------------------------------------------------------------------------
class _Store:
    """What the Pollers read from Redis: one endpoint list, the latest LoadRecords, no catalog."""

    def __init__(self, endpoints: list[EndpointInfo]):
        self.eps = endpoints
        self.records: dict[str, LoadRecord] = {}

    def catalog_outline(self) -> CatalogOutline:  # no catalog
        return CatalogOutline()

    def key_variables(self) -> list:
        return []

    def endpoints_version(self) -> int:
        return 1

    def read_endpoints(self):
        return 1, "fleetsim", list(self.eps)

    def loads(self, ids):
        return {i: self.records[i] for i in ids if i in self.records}


@dataclass
class Req:
    rid: int
    arrival: float
    prompt: int
    output: int
    priority: str
    gateway: int
    attempt: int = 0
    exclude: frozenset = frozenset()
    choice: Choice | None = None
    sent: float = 0.0
    first: float | None = None  # first token (client side)
    done: float | None = None
    status: str = ""  # ok | shed | error
    endpoint: str = ""
    deadline: float = math.inf  # end of its wait in the gateway's queue
    waiting: Queue | None = None  # the admission step that queued it (what keeps it waiting, for how long)
    session: int = -1  # conversation workloads: its session's index, and which turn it is
    turn: int = 0
    tokens: tuple[int, ...] | None = None  # its prompt's and answer's tokens, for the engines' caches
    out_tokens: tuple[int, ...] | None = None
    # Conversation turns: what the gateway derives from the request's body (gateway.request.call's
    # plan_prefix), for a streamed chat request as bench/prefix.py's client sends it.
    keys: tuple[int, ...] = ()
    prompt_estimate: float = 0.0
    opens: bool = False
    cached: int = 0  # prompt tokens the engine found cached (llama.cpp reports it per answer)
    # Whom it is served for when its model is saturated (bench/fairness.py's tenants; None: no key),
    # what the gateway charged it (gateway.routing.ledger.Charge, once, as gateway.http.attempt), and
    # its time in the gateway's queue.
    tenant: Tenant | None = None
    charge: object | None = None
    queued_at: float = 0.0
    in_queue: bool = False
    # Its latency targets (bench/slo.py), as routing reads them from its arrival (gateway.routing.slo:
    # the time since is its `waited`), and when its first byte is due; None / inf: none.
    slo: Slo | None = None
    due: float = math.inf
    refusal: Refuse | None = None  # the admission step that refused it (its 429's reason and Retry-After)


@dataclass
class Result:
    fleet: str
    load: str
    policy: str
    seed: int
    requests: list[Req] = field(default_factory=list)
    cache: tuple[float, float] = (0.0, 0.0)  # prompt tokens the engines found cached, looked up (after warm-up)

    def ok(self) -> list[Req]:
        return [r for r in self.requests if r.status == "ok"]

    def measured(self, warmup: float) -> "Result":
        return Result(self.fleet, self.load, self.policy, self.seed, [r for r in self.requests if r.arrival >= warmup],
                      self.cache)

    def add(self, other: "Result") -> None:
        """Pool another seed's run of the same cell into this one."""
        self.requests = self.requests + other.requests
        self.cache = (self.cache[0] + other.cache[0], self.cache[1] + other.cache[1])

    def hit_ratio(self) -> float:
        return self.cache[0] / self.cache[1] if self.cache[1] else 0.0

    def pct(self, what: str, p: float) -> float:
        key = {"lat": lambda r: r.done - r.arrival, "ttft": lambda r: r.first - r.arrival,
               "held": lambda r: r.sent - r.arrival}[what]
        xs = sorted(key(r) for r in self.ok())
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    def errors(self) -> int:
        return sum(r.status != "ok" for r in self.requests)

    def shares(self, names: list[str]) -> list[int]:
        return [sum(r.endpoint == n and r.status == "ok" for r in self.requests) for n in names]


def gateway_shell(sim: "Simulation", idx: int, router, pollers=None, exchange=None) -> GatewayShell:
    """Gateway process `idx` of `sim` (bench/simshell.py), routed by the modelled peer its policy
    names, if any (MODELLED). Its figures were taken with a request that joins the queue waiting for
    the next release or load refresh before it routes again."""
    return GatewayShell(sim, idx, router, pollers, exchange, peer=MODELLED.get(sim.policy))


def _llamacpp_slots(sim: SimConfig) -> Slots:
    """llama.cpp's slots as `python -m simengine --metrics-style llamacpp` keeps them by default: a
    slot chosen by prompt similarity, and llama-server's host-memory prompt cache behind them."""
    opts = ServerOptions("127.0.0.1", 0, ("m",), core=sim, metrics_style="llamacpp")
    return Slots(sim.max_seqs, opts.slot_similarity, cache_tokens=prompt_cache_tokens(opts))


class _Engine:
    def __init__(self, sim: "Simulation", spec: Engine, caching: bool = False):
        self.sim, self.spec = sim, spec
        llamacpp = sim.fleet.make == "llamacpp"
        # A prefix cache only where prompts come as tokens (conversations): as the engine defaults.
        self.core = SimCore(spec.sim, prefix=PrefixCache() if caching and not llamacpp else None,
                            slots=_llamacpp_slots(spec.sim) if caching and llamacpp else None)
        self.reqs: dict[str, Req] = {}
        self.busy = False
        self.step: tuple | None = None  # the step in progress and when it ends (bench/oracle.py reads it)
        self.gen = 0  # step generation: a failure invalidates the step in progress
        self.prefill_seconds = 0.0  # the steps' prefill share, summed (simengine.engine's busy_prompt)

    def dead(self, now: float) -> bool:
        return self.spec.fail_at is not None and now >= self.spec.fail_at

    def submit(self, req: Req, now: float) -> None:
        rid = str(req.rid)
        if req.tokens is not None:
            self.core.submit(rid, req.prompt, req.output, now, tokens=list(req.tokens), output=list(req.out_tokens))
        else:
            self.core.submit(rid, req.prompt, req.output, now)
        self.reqs[rid] = req
        if not self.busy:
            self._plan(now)

    def _plan(self, now: float) -> None:
        step = self.core.plan_step(now)
        self.busy = step is not None
        self.step = (step, now + step.duration) if step is not None else None
        if step is not None:
            self.sim.at(now + step.duration, "step", (self, step, self.gen))

    def step_done(self, step, gen: int) -> None:
        if gen != self.gen:
            return
        now = self.sim.now
        self.prefill_seconds += max(0.0, step.duration - step.decode)
        for e in self.core.finish_step(step, now):
            req = self.reqs.get(e.rid)
            if req is None:
                continue
            if e.index == 0:
                req.first, req.cached = now, e.cached or 0
            if e.done:
                del self.reqs[e.rid]
                req.done = now
                self.sim.finish(req, "ok")
                self.sim.gateways[req.gateway].release(req, ok=True)
        self._plan(now)

    def fail(self) -> None:
        self.gen += 1
        self.busy, self.step = False, None
        for rid, req in list(self.reqs.items()):
            self.core.cancel(rid)
            self.sim.finish(req, "error")
            self.sim.gateways[req.gateway].release(req, ok=False)
        self.reqs.clear()

    def record(self, now: float) -> LoadRecord:
        if self.dead(now):
            return LoadRecord(replica_id=self.spec.name, ts=now, ok=False, error="connection refused")
        c = self.core
        if self.sim.fleet.make == "llamacpp":  # llama-server's /metrics: no KV gauge, only computed prompt tokens
            return LoadRecord(replica_id=self.spec.name, ts=now, ok=True, running=float(c.num_running),
                              waiting=float(c.num_waiting), kv_usage=None,
                              prompt_tokens_total=float(c.prompt_tokens_total - c.prompt_cached_total),
                              generation_tokens_total=float(c.generation_tokens_total),
                              prefill_seconds_total=self.prefill_seconds)  # llamacpp:prompt_seconds_total
        cache = c.prefix  # vLLM's vllm:prefix_cache_queries / _hits, as the agent scrapes them
        return LoadRecord(replica_id=self.spec.name, ts=now, ok=True, running=float(c.num_running),
                          waiting=float(c.num_waiting), kv_usage=c.kv_usage,
                          prompt_tokens_total=float(c.prompt_tokens_total),
                          generation_tokens_total=float(c.generation_tokens_total),
                          prefix_queries_total=float(cache.queries) if cache is not None else None,
                          prefix_hits_total=float(cache.hits) if cache is not None else None,
                          prefill_seconds_total=self.prefill_seconds,  # vllm:request_prefill_time_seconds_sum
                          # vllm:request_prefill_kv_computed_tokens_sum, counted with those seconds
                          prefill_tokens_total=float(c.prompt_tokens_total - c.prompt_cached_total),
                          kv_tokens=c.config.kv_tokens)  # vllm:cache_config_info


class Simulation(EventLoop):
    def __init__(self, fleet: Fleet, load: Load, policy: str, seed: int, cfg: GatewaySettings | None = None,
                 scrape: float = 1.0, load_interval: float = 0.5, workload: str = "random"):
        if workload != "random" and load.burst_seconds:
            raise ValueError("conversation workloads run at a steady rate: choose a load without a burst")
        super().__init__()
        self.fleet, self.load, self.policy, self.seed, self.workload = fleet, load, policy, seed, workload
        self.sessions: list[conv.Session] = []
        base = cfg or GatewaySettings()
        routing = base.routing.model_copy(update={"policy": "llmgw" if modelled(policy) else policy})
        self.cfg = base.model_copy(update={"seed": seed, "routing": routing})
        self.scrape, self.load_interval = scrape, load_interval
        self.rng = random.Random(seed)
        self.engines = {e.name: _Engine(self, e, caching=workload != "random") for e in fleet.engines}
        eps = [EndpointInfo(id=e.name, url=f"sim://{e.name}", models=("m",), engine="sim", model="m", served_name="m",
                            capacity=e.capacity, priority=e.priority) for e in fleet.engines]
        self.store = _Store(eps)
        self.gateways: list[GatewayShell] = []
        # gateway.server.sendshare: what each sends and holds, for the other gateways (only llmgw's
        # routing: the baselines stand for peers whose instances share nothing)
        shares = fleet.gateways > 1 and self.cfg.share_sends > 0 and policy == "llmgw"
        for g in range(fleet.gateways):
            router, exchange, pollers = gateway_parts(self.store, self.cfg.model_copy(update={"seed": seed * 100 + g}),
                                                      self.clock, shares)
            self.gateways.append(gateway_shell(self, g, router, pollers, exchange))
        self.result = Result(fleet.name, load.name, policy, seed)

    def finish(self, req: Req, status: str) -> None:
        if req.status:
            return
        req.status = status
        self.pending -= 1
        if status != "ok":
            req.done = self.now
        elif req.session >= 0 and req.turn + 1 < len(self.sessions[req.session].turns):
            # The session's next turn, a think time after this answer (a failed turn ends the session).
            turn = self.sessions[req.session].turns[req.turn]
            nxt = self._turn(req.session, req.turn + 1, self.now + turn.think, len(self.result.requests))
            self.result.requests.append(nxt)
            self.pending += 1
            self.at(nxt.arrival, "arrival", nxt)

    def _turn(self, session: int, turn: int, at: float, rid: int) -> Req:
        t = self.sessions[session].turns[turn]
        body = {"model": "m", "messages": list(t.messages), "max_tokens": len(t.output), "stream": True}
        keys, estimate = prefix_of(body, CHAT, "m")
        return Req(rid, at, len(t.tokens), len(t.output), "standard", rid % self.fleet.gateways, session=session,
                   turn=turn, tokens=t.tokens, out_tokens=t.output, keys=keys, prompt_estimate=estimate,
                   opens=opens_conversation(body, CHAT))

    def _arrivals(self) -> list[Req]:
        """The load's Poisson arrivals (harness.loadgen, as bench/routing.py sends them), each
        with its prompt and output length drawn from the fleet's distributions."""
        if self.workload == "prefix":  # bench/prefix.py's own traffic, as its defaults send it
            convs = traffic.workload(PREFIX_CONVERSATIONS, PREFIX_RATE, conv.MIX, self.seed)
            self.sessions = conv.sessions(convs, self.seed)
            return [self._turn(i, 0, s.start, i) for i, s in enumerate(self.sessions)]
        if self.workload != "random":
            _, convs = conv.sized(self.fleet, self.workload, self.load.fraction, self.load.seconds, self.seed)
            self.sessions = conv.sessions(convs, self.seed)
            return [self._turn(i, 0, s.start, i) for i, s in enumerate(self.sessions)]
        rng = random.Random(self.seed * 7919 + 1)
        times = poisson_times(self.load.rate_at(self.fleet.capacity()), self.load.peak(self.fleet.capacity()),
                              self.load.seconds, self.seed)
        out = []
        for t in times:
            prompt, output, u = self.fleet.prompt.sample(rng), self.fleet.output.sample(rng), rng.random()
            prio = "sheddable" if u < self.load.sheddable else "critical" if u > 1 - self.load.critical else "standard"
            out.append(Req(len(out), t, prompt, output, prio, len(out) % self.fleet.gateways))
        return out

    def run(self) -> Result:
        reqs = self._arrivals()
        self.result.requests = reqs
        for r in reqs:
            self.at(r.arrival, "arrival", r)
        for i, e in enumerate(self.engines.values()):
            self.at(self.rng.uniform(0, self.scrape), "scrape", e)
            if e.spec.fail_at is not None:
                self.at(e.spec.fail_at, "fail", e)
        for g in self.gateways:
            self.at(self.rng.uniform(0, self.load_interval), "poll", g)
            if g.exchange.shares_sends:
                self.at(self.rng.uniform(0, self.cfg.share_sends), "sends", g)
        if self.workload != "random":
            self.at(self.load.warmup, "mark", None)
        self.marked: dict[str, tuple[float, float]] = {}
        self.pending = len(reqs)
        self.loop(self.load.seconds + 600.0)
        if self.workload != "random":
            after = self._counters()
            self.result.cache = (sum(after[n][0] - self.marked.get(n, (0.0, 0.0))[0] for n in after),
                                 sum(after[n][1] - self.marked.get(n, (0.0, 0.0))[1] for n in after))
        return self.result

    def on_fail(self, t: float, engine: "_Engine") -> None:
        engine.fail()

    def on_mark(self, t: float, _) -> None:
        """The warm-up ends: the hit ratio counts from here."""
        self.marked = self._counters()

    def on_call(self, t: float, call: Callable[[], None]) -> None:
        """A client of another bench module's (bench/batch.py's feeder)."""
        call()

    def _counters(self) -> dict[str, tuple[float, float]]:
        return {n: conv.core_counters(e.core, self.fleet.make) for n, e in self.engines.items()}


def run(fleet: Fleet, load: Load, policy: str, seed: int = 1, cfg: GatewaySettings | None = None,
        workload: str = "random") -> Result:
    """The requests that arrived after the load's warm-up."""
    return Simulation(fleet, load, policy, seed, cfg, workload=workload).run().measured(load.warmup)


def zero_variance_e2e(result: Result, fleet: Fleet) -> tuple[float, float, float] | None:
    """What the longest answer of a run would take end to end with no variance at all: every engine
    running the run's mean batch and spending the run's mean share of its time on prefills, the
    answer's time to first token left out. Returns (mean running sequences per engine, prefill share,
    seconds), over the busy part of the run (the 10th to the 90th percentile of arrivals). No router
    changes the mean batch or, at equal hit ratios, the prefill share: what an end-to-end p99 has
    above this figure is the variance routing can still remove. None on a fleet of unlike engines
    (a mean over them says nothing of any one)."""
    if len({e.sim for e in fleet.engines}) > 1:
        return None
    rs = sorted(result.ok(), key=lambda r: r.arrival)
    a, b = rs[len(rs) // 10].arrival, rs[9 * len(rs) // 10].arrival
    n, sim = len(fleet.engines), fleet.engines[0].sim
    # requests held per engine, sent to done (the ones waiting in it too), as a batch of at most max_seqs
    running = min(sim.max_seqs, sum(max(0.0, min(r.done, b) - max(r.sent, a)) for r in rs) / (b - a) / n)
    prefill = sum(sim.prefill_seconds(r.prompt - r.cached) for r in rs if a <= r.first <= b) / (b - a) / n
    longest = max(r.output for r in rs)
    return running, prefill, (longest - 1) * sim.decode_seconds(1) * (1 + sim.batch_alpha * (running - 1)) / (1 - prefill)


# --- command line ------------------------------------------------------------------------------------
def table(results: list[Result], fleet: Fleet, hits: bool = False) -> list[str]:
    """One row per result; `hits` adds the engines' hit ratio after the TTFT columns."""
    names = [e.name for e in fleet.engines]
    lines = []
    for r in results:
        n = len(r.requests)
        share = "/".join(str(x) for x in r.shares(names))
        hit = f" {100 * r.hit_ratio():5.1f}%" if hits else ""
        lines.append(f"  {r.load:6} {r.policy:15} {r.pct('lat', .5):7.2f} {r.pct('lat', .9):7.2f} {r.pct('lat', .99):7.2f} "
                     f"{r.pct('ttft', .5):7.3f} {r.pct('ttft', .99):7.3f}{hit} {r.pct('held', .99):7.3f} "
                     f"{r.errors():5}/{n:<5} {share}")
    return lines


@dataclass(frozen=True)
class Verdict:
    """llmgw against the best peer of one cell: ratios of p99 and TTFT p99 (below 1 is better)."""

    fleet: str
    load: str
    p99: float
    ttft99: float
    p99_ratio: float
    ttft99_ratio: float
    errors: int
    peer_errors: int


def compare(results: dict[str, Result]) -> Verdict:
    """`results` by policy, one of them "llmgw"; the others are its peers."""
    mine = results["llmgw"]
    peers = [r for p, r in results.items() if p != "llmgw"]
    best_p99 = min(r.pct("lat", .99) for r in peers)
    best_ttft = min(r.pct("ttft", .99) for r in peers)
    return Verdict(mine.fleet, mine.load, mine.pct("lat", .99), mine.pct("ttft", .99),
                   mine.pct("lat", .99) / best_p99, mine.pct("ttft", .99) / best_ttft, mine.errors(),
                   min(r.errors() for r in peers))


def print_bounds(fleet: Fleet, seeds: Iterable[int], bounds: dict[str, list[tuple[float, float, float] | None]]) -> None:
    """Under the replay's table: bench/prefix.py's `no queue` floor of the time to first token, and
    each router's `zero_variance_e2e` (the means over the seeds) on a fleet of like engines."""
    fastest = max((e.sim for e in fleet.engines), key=lambda c: c.speed)
    least = [x for seed in seeds
             for x in traffic.floor(traffic.workload(PREFIX_CONVERSATIONS, PREFIX_RATE, conv.MIX, seed), fastest)]
    print(f"  {'':6} {'no queue':15} {'':>7} {'':>7} {'':>7} {pct(least, .5):7.3f} {pct(least, .99):7.3f}"
          "  (the floor of the first token: each request's unavoidable prefill, on an idle engine)")
    for policy, rows in bounds.items():
        if None in rows:
            continue
        running, prefill, seconds = (sum(x[i] for x in rows) / len(rows) for i in range(3))
        print(f"  {'':6} {policy:15} zero-variance e2e of the longest answer {seconds:.2f} s "
              f"(batch {running:.2f}, prefill {100 * prefill:.0f} % of the time)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleets", default="", help="comma-separated names (default: the benchmark's five)")
    ap.add_argument("--held-out", action="store_true", help="the fleets the policy was not designed on")
    ap.add_argument("--loads", default=None, help="default 0.5,0.8,0.95,burst (conversation workloads: no burst)")
    ap.add_argument("--policies", default="llmgw,least_inflight,round_robin,power_of_two")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.0, help="override each load's length")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a GatewaySettings or RoutingConfig field for llmgw (repeatable)")
    ap.add_argument("--workload", choices=conv.WORKLOADS + ("prefix",), default="random",
                    help="random prompts (default), or bench/prefix.py's sessions over shared system prompts: "
                         f"conversations, or mix ({100 * conv.MIX:.0f}%% one-shot requests), sized to a load; "
                         "or prefix: bench/prefix.py's own traffic on its fleets (prefix-bench, prefix-uneven)")
    ap.add_argument("--make", choices=conv.MAKES, default="vllm",
                    help="the engines' prefix cache and /metrics: vLLM's (default) or llama.cpp's slots")
    ap.add_argument("--first-seed", type=int, default=1, help="the seeds run are this one and the next --seeds - 1")
    ap.add_argument("--gateways", type=int, default=0,
                    help="gateway processes behind round robin (default: each fleet's own, 1 but for two-gateways); "
                         "llmgw's share what they send and hold every LLMGW_GATEWAY_SHARE_SENDS "
                         "(--set share_sends=0: not at all), each smg_cache_aware keeps its own tree")
    a = ap.parse_args(argv)
    if a.gateways < 0:
        ap.error("--gateways must be a positive number (0: each fleet's own)")
    talk, replay = a.workload != "random", a.workload == "prefix"
    if replay:
        if a.loads or a.seconds:
            ap.error("--workload prefix sends bench/prefix.py's traffic: it takes no --loads or --seconds")
        a.fleets = a.fleets or "prefix-bench"
    a.loads = a.loads or ("prefix" if replay else "0.5,0.8,0.95" if talk else "0.5,0.8,0.95,burst")
    loads = {**LOADS, "prefix": PREFIX_LOAD}
    for lname in a.loads.split(","):
        if lname not in LOADS and not replay:
            ap.error(f"unknown load {lname!r}; choose from {', '.join(LOADS)}")
        if talk and loads[lname].burst_seconds:
            ap.error("conversation workloads run at a steady rate: choose from 0.5, 0.8, 0.95")
    cfg = GatewaySettings()
    for item in a.set:
        k, v = item.split("=", 1)
        if k in type(cfg.routing).model_fields:
            cfg = cfg.model_copy(update={"routing": cfg.routing.model_copy(update={k: float(v)})})
        else:
            cfg = cfg.model_copy(update={k: float(v)})
    pool = {**FLEETS, **HELD_OUT, **prefix_fleets()}
    verdicts: list[Verdict] = []
    names = a.fleets.split(",") if a.fleets else list(HELD_OUT if a.held_out else FLEETS)
    for fname in names:
        if fname not in pool:
            ap.error(f"unknown fleet {fname!r}; choose from {', '.join(pool)}")
        fleet = replace(pool[fname], make=a.make)
        if a.gateways:
            fleet = replace(fleet, gateways=a.gateways)
        if fleet.gateways > 1:
            fleet = replace(fleet, note=", ".join(filter(None, (fleet.note, f"{fleet.gateways} gateways behind round robin"))))
        if replay:
            print(f"{fname}: bench/prefix.py's traffic ({PREFIX_CONVERSATIONS} conversations at {PREFIX_RATE:g}/s, "
                  f"{100 * conv.MIX:.0f}% one-shot) on {a.make} engines{(' (' + fleet.note + ')') if fleet.note else ''}")
        elif talk:
            sized, _ = conv.sized(fleet, a.workload, 0.8, a.seconds or LOADS["0.8"].seconds, 1)
            print(f"{fname}: {a.workload} on {a.make} engines, capacity {sized.capacity():.1f} req/s for prompts of "
                  f"~{sized.prompt.a:.0f} tokens{(' (' + fleet.note + ')') if fleet.note else ''}")
        else:
            print(f"{fname}: capacity {fleet.capacity():.1f} req/s{(' (' + fleet.note + ')') if fleet.note else ''}")
        print(f"  {'load':6} {'policy':15} {'p50':>7} {'p90':>7} {'p99':>7} {'ttft50':>7} {'ttft99':>7}"
              f"{' ' + format('hits', '>6') if talk else ''} {'held99':>7} {'err/n':>11} served")
        for lname in a.loads.split(","):
            load = loads[lname]
            if a.seconds:
                load = replace(load, seconds=a.seconds)
            cell, bounds = {}, {}
            for policy in a.policies.split(","):
                merged = None
                per_seed = []
                for seed in range(a.first_seed, a.first_seed + a.seeds):
                    r = run(fleet, load, policy, seed, cfg, a.workload)
                    if replay:  # before the seeds' requests are merged into the first one's result
                        per_seed.append(zero_variance_e2e(r, fleet))
                    if merged is None:
                        merged = r
                    else:
                        merged.add(r)
                cell[policy] = merged
                print("\n".join(table([merged], fleet, hits=talk)), flush=True)
                if replay:
                    bounds[policy] = per_seed
            if replay:
                print_bounds(fleet, range(a.first_seed, a.first_seed + a.seeds), bounds)
            if "llmgw" in cell and len(cell) > 1:
                verdicts.append(compare(cell))
    if verdicts:
        print("\nllmgw / best peer:  p99 ratio, TTFT p99 ratio (<= 1 is the target), errors")
        for v in verdicts:
            flag = "" if v.p99_ratio <= 1.0 and v.ttft99_ratio <= 1.0 and v.errors <= v.peer_errors else "  <-- behind"
            print(f"  {v.fleet:18} {v.load:6} {v.p99_ratio:5.2f} {v.ttft99_ratio:5.2f} {v.errors:4}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
