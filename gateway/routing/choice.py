"""Where a request goes: a pure `choose(endpoints, loads, inflight, request, now) -> Choice | Rejection`.

The load-aware policy (`llmgw`) sends a request where it is expected to complete soonest, counting
what it costs the others: for each endpoint, with `held` requests already on it (the gateway's own
in-flight count, exact and immediate, plus what other gateways sent as seen in the last scrape),
`completion + imposed` from its learned `Speed` (gateway.routing.speed): time to first byte, the wait for a
slot once its batch is full, and the decode time at the batch size it will run in, which grows with
every extra sequence; plus the slowdown it adds to the sequences already running there. So a fast
endpoint is filled while its growing batch still beats a slower one, a slow endpoint with free
slots takes requests as soon as it is the quicker way out, and nothing waits in the gateway while
an endpoint could serve it sooner than the queue would. Scores within `tie_tolerance` of the best
are picked at random, so many gateways do not herd onto one endpoint.

The request waits in the gateway only when every endpoint is saturated (its `capacity`, or the
engine's own queue or KV cache), or when a saturated endpoint frees a slot so soon that waiting for
it beats every open one by `wait_margin`. Priority tiers: the highest tier that has an unsaturated
endpoint takes the request. A request with an affinity key (session) goes to its rendezvous-hash
endpoint while that one is not overloaded.

Prefix caches (gateway.routing.prefixkeys, prefixindex): the prefill a request still needs at an
endpoint, its prompt less what that endpoint is expected to hold, is part of the same cost, so a hit
is traded against queueing; near-ties go by rendezvous hashing of the prompt's head, so gateways
that have not seen a conversation agree on its replica. A streamed request minimises its expected
first token, a non-streamed one its completion (`RouteRequest.objective`).
"""

from __future__ import annotations

import hashlib
import math
import operator
import random
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Callable, Mapping, NamedTuple, Sequence

from gateway.config import RoutingConfig
from gateway.routing.load import EndpointStats, ahead_of, engine_saturated, fresh_load, slots_of
from gateway.routing.prefixkeys import TOKENS_PER_BLOCK
from gateway.routing.speed import PRIOR_SLOWDOWN, Speed
from llmgw.state.records import EndpointInfo, LoadRecord
from llmgw.surface import CHAT


_DECODE1 = operator.attrgetter("decode1")
NOTHING_KNOWN = Speed(1.0, PRIOR_SLOWDOWN)  # before any speed is learned: all alike, so the emptiest wins


# What a request minimises (RouteRequest.objective): its expected first token, or its completion.
FIRST_TOKEN, COMPLETION = "first_token", "completion"
MISSES = "slo_miss"  # a strict request no open endpoint is predicted to serve within its targets (Rejection.kind)


class Slo(NamedTuple):
    """A request's latency targets as routing reads them (llmgw.slo): the seconds left for its first byte
    and for its whole answer as this attempt began routing (less `RouteRequest.waited` as it waits in
    the queue; None: no such target), its seconds per token, whether it is strict (refused rather than
    served late) and whether its client streams (else its first byte is its whole answer)."""

    ttft: float | None
    tpot: float | None
    total: float | None
    strict: bool = False
    stream: bool = True


def lateness(pred: tuple[float, float | None, float] | None, slo: Slo, waited: float) -> float:
    """How far a prediction (`predict`) misses a request's targets, each miss over its target (0: it
    meets them all; a prediction not yet learned meets them)."""
    if pred is None:
        return 0.0
    first, tpot, total = pred
    if not slo.stream:
        first = total
    worst = 0.0
    if slo.ttft is not None:
        left = slo.ttft - waited
        worst = max(worst, (first - left) / max(slo.ttft, 1e-3))
    if slo.tpot is not None and tpot is not None:
        worst = max(worst, (tpot - slo.tpot) / slo.tpot)
    if slo.total is not None:
        left = slo.total - waited
        worst = max(worst, (total - left) / max(slo.total, 1e-3))
    return worst


def spare(pred: tuple[float, float | None, float] | None, slo: Slo, waited: float) -> float:
    """Seconds a request predicted `pred` has to spare on its first byte (else its whole answer)."""
    if pred is None:
        return 0.0
    if slo.ttft is not None:
        return slo.ttft - waited - (pred[0] if slo.stream else pred[2])
    if slo.total is not None:
        return slo.total - waited - pred[2]
    return math.inf


@dataclass(frozen=True)
class RouteRequest:
    model: str
    priority: str = "standard"  # critical | standard | sheddable (only `critical` matters here)
    affinity: str | None = None  # X-Session-ID or OpenAI `user`
    exclude: frozenset[str] = frozenset()  # endpoints already tried for this request (retries)
    queued: int = 1  # requests of this model waiting in the gateway, this one included
    _: KW_ONLY  # named only: a positional argument never lands in one of these
    op: str = CHAT  # the operation (llmgw.surface): only endpoints that serve it are candidates
    pin: str | None = None  # the one endpoint it may go to (a response's, by its id)
    waited: float = 0.0  # seconds this request has already waited in the gateway's queue
    # The request's parsed body, for precise prefix matching (endpoints that publish KV events).
    body: Mapping | None = None
    # Prefix-cache awareness (gateway.routing.prefixkeys): the prompt's block keys, its length in
    # tokens (estimated), and what the request minimises: FIRST_TOKEN (streamed) or COMPLETION.
    prefix: tuple[int, ...] = ()
    prompt_tokens: float = 0.0
    objective: str = COMPLETION
    # It starts a conversation (no earlier answer in its prompt, prefixkeys.opens_conversation): its
    # later turns follow it, so it is placed with bounded load (see `_pick`).
    opens: bool = False
    # Its latency targets (None: none; routed as before, at no cost): among the endpoints predicted to
    # meet them it is routed as usual; when none will, a strict one is refused (MISSES), any other goes
    # where its miss is smallest (`_with_targets`).
    slo: Slo | None = None
    # An endpoint where another gateway paused one of its answers for this request (gateway.routing.
    # remote_eviction): that slot is its own, though the endpoint looks full until that gateway reports.
    granted: str | None = None
    # It continues an answer that broke or was evicted (gateway.http.resume): it avoids the endpoints a
    # rolling update is replacing (`EndpointInfo.retiring`) while another can serve it.
    continuation: bool = False


@dataclass(frozen=True)
class Choice:
    endpoint: EndpointInfo
    score: float
    ahead: int  # requests the endpoint holds before this one (for learning the service time)
    saturated: bool = False  # True when sent past saturation (critical traffic)
    reason: str = ""
    adapter: str = ""  # the LoRA adapter it was routed for (gateway.routing.adapters), counted by name
    matched: float = 0.0  # prompt tokens the chosen endpoint is expected to hold (prefix cache)
    saved: float = 0.0  # prefill seconds that match is expected to save
    prompt: float = 0.0  # the request's prompt tokens (estimated; 0: routed without block keys)
    kv_events: bool = False  # `matched` is what the engine reported holding (precise mode), not a prediction
    prefill: float = 0.0  # prefill seconds the request still needs there (its backlog, gateway.routing.backlog)
    behind: float = 0.0  # prefill seconds already queued there when it was sent (the backlog it waits for)
    waited: float = 0.0  # seconds the request waited in the gateway's queue before this choice
    # What the request is predicted to get there, in seconds from now (`predict`; None: the endpoint's
    # speed is not learned yet): its first token, its seconds per token after the first (None also
    # while the tokens per answer are unknown), and its whole answer. Tally records them beside what
    # happened (the predictor's error per engine) and judges the request's targets by what happened.
    predicted_ttft: float | None = None
    predicted_tpot: float | None = None
    predicted_total: float | None = None
    # The open endpoint of the same tier that came next, for a request routed with prefix keys and no
    # latency targets: (its id, its cost in seconds of the objective, the prompt tokens expected cached
    # there). The answer's X-LLMGW-Prefix header names it, so a turn that left the replica holding its
    # history says what that replica was expected to cost.
    runner_up: tuple[str, float, float] | None = None


@dataclass(frozen=True)
class Rejection:
    kind: str  # "unknown_model" | "unsupported" | "no_ready" | "saturated"
    model: str
    detail: str = ""
    # A deferral that time alone ends: seconds until routing would send the request after all (the
    # wait queue looks again then, not on a poll).
    retry_in: float | None = field(default=None, compare=False)
    # A request with targets: the first byte it is predicted to get, in seconds from the moment a slot
    # frees (saturated) or from now (MISSES, on the endpoint nearest its targets); None: not predicted.
    predicted: float | None = field(default=None, compare=False)


class _Cand(NamedTuple):  # a tuple: built for every endpoint on every request
    ep: EndpointInfo
    ahead: int
    saturated: bool
    score: float
    soft: bool  # saturated only by what it holds reaching capacity (not by the engine)
    speed: Speed
    slots: float
    matched: float = 0.0  # prompt tokens expected cached there
    saved: float = 0.0  # the prefill seconds that saves there
    prefill: float = 0.0  # the prefill seconds it still needs there
    behind: float = 0.0  # the backlog of prefill queued there before it
    # For an endpoint full by capacity: what its prompt would add to the cost there once a slot frees
    # (its prefill, the batch it stalls, the backlog before it), so waiting for it is weighed like
    # sending to an open endpoint, whose score has the same terms (_better_to_wait).
    prompt_when_free: float = 0.0


def effective_speed(st: EndpointStats | None, best: Speed | None, now: float, cfg: RoutingConfig) -> Speed | None:
    """The learned speed, relaxed toward the fleet's best while the endpoint gets no samples (an
    endpoint that was slow once is tried again). Unknown endpoints are assumed as good as the best:
    they get explored."""
    if st is None or st.speed is None:
        return best
    age = now - st.last_sample
    if best is None or st.speed.decode1 <= best.decode1 or age < 0.01 * cfg.forget_half_life:
        return st.speed
    return st.speed.relaxed_toward(best, 0.5 ** (age / cfg.forget_half_life))


def score(speed: Speed, held: float, slots: float, weight: float, kv: float | None, cfg: RoutingConfig,
          prefill: float = 0.0, objective: str = COMPLETION, evicts: float = 0.0, backlog: float = 0.0,
          joins_full: bool = False) -> float:
    """Seconds until a request sent now completes (its first token, for FIRST_TOKEN), plus
    `imposed_weight` times what it adds to the others' completions; stretched by KV-cache pressure and
    divided by the catalog weight. `prefill` is the seconds of prompt the engine must still compute
    there (what its prefix cache does not hold): the request waits for it, and so does every
    sequence running beside it (a prefill step stalls the batch); and `evicts` times it again: what
    the prompt written into the engine's cache pushes out of it, worth what that cache's prompts
    saved lately (`evict_weight` times the share of prompt tokens the engine served from it).
    `backlog` is the prefill seconds just sent there and likely not done (gateway.routing.backlog):
    the request's own prefill starts after them, unless its wait for a slot outlasts them.
    `joins_full`: the request waits in the engine's queue past its capacity (it holds the prompt,
    see `choose`); once a slot frees it runs in a full batch and slows the others there as any
    request joining a batch does, which `Speed.imposed` leaves out for a queued request."""
    if objective == FIRST_TOKEN:
        cost = speed.first_token(held, slots)
    else:
        cost = speed.completion(held, slots)
    if backlog:
        # held + 1 <= slots: no wait for a slot, the whole backlog is ahead of the request
        cost += backlog if held + 1.0 <= slots else max(0.0, backlog - (speed.first_token(held, slots) - speed.ttfb))
    joined = slots - 1.0 if joins_full and held + 1.0 > slots else held
    cost += cfg.imposed_weight * speed.imposed(joined, slots)
    if prefill:
        cost += prefill * (1.0 + cfg.imposed_weight * min(held, slots) + evicts)
    if kv:
        cost *= 1.0 + cfg.kv_weight * kv
    return cost / max(weight, 1e-6)


def _rendezvous(key: str, ep_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{ep_id}".encode(), digest_size=8).digest(), "big")


def eligible(endpoints: Sequence[EndpointInfo], request: RouteRequest, stats: Mapping[str, EndpointStats],
             now: float) -> list[EndpointInfo] | Rejection:
    """The endpoints that may take `request` (its model, its pinned endpoint, its operation, not yet
    tried for it), or why there are none."""
    serving = [e for e in endpoints if request.model in e.models
               and (request.pin is None or e.id == request.pin)]
    if not serving:
        return Rejection("unknown_model", request.model)
    able = [e for e in serving if e.serves(request.op)]
    if not able:
        engines = ", ".join(sorted({e.engine for e in serving}))
        return Rejection("unsupported", request.model, f"its endpoints ({engines}) do not serve it")
    tried = [e for e in able if e.id not in request.exclude]
    if not tried:
        return Rejection("no_ready", request.model, "every endpoint failed for this request")
    # Endpoints that refused a connection a moment ago are passed over while any other can serve
    # (when all of them did, trying one is still better than refusing the request).
    up = [e for e in tried if (s := stats.get(e.id)) is None or s.down_until <= now]
    if request.continuation:
        # A continuation broke once already; on a replica being replaced it would break again under
        # its drain (a rolling update's drain deadline shorter than the answer: tests/e2e/test_drain.py).
        staying = [e for e in (up or tried) if not e.retiring]
        if staying:
            return staying
    return up or tried


@dataclass(frozen=True, slots=True)
class RouteContext:
    """Everything a routing decision reads besides the request, as of the moment it is made.

    `endpoints` are the candidates (a model's, or an adapter's holders); `loads` the engines' last
    scraped LoadRecords; `held` what this gateway counts on each endpoint (its own in-flight requests,
    exact and immediate, plus its sibling workers' and the other gateways'); `now` the caller's
    monotonic clock (load freshness via `stats[...].load_seen`, learned speeds via `last_sample`);
    `stats` what was learned of each endpoint; `rng` is always the caller's, so a seed reproduces every
    choice; `policy` the caller's instance of the policy `cfg.policy` names (`policy_of`: round robin
    keeps its turn in it; None: a fresh one). `matched` is how many of the request's
    leading prefix keys each endpoint was sent lately (gateway.routing.prefixindex): the prefill it
    saves comes off that endpoint's cost. For the endpoints in `exact` it is what the engine reports
    holding (its KV events, gateway.routing.precise), taken as it is rather than discounted by how
    well predictions held there. `backlog` is each endpoint's prefill seconds sent lately and likely
    not done (gateway.routing.backlog)."""

    endpoints: Sequence[EndpointInfo]
    loads: Mapping[str, LoadRecord]
    held: Mapping[str, int]
    now: float
    rng: random.Random
    cfg: RoutingConfig = RoutingConfig()
    stats: Mapping[str, EndpointStats] = field(default_factory=dict)
    policy: "Policy | None" = None
    matched: Mapping[str, float] | None = None
    exact: frozenset[str] = frozenset()
    backlog: Mapping[str, float] | None = None


def choose(ctx: RouteContext, request: RouteRequest) -> Choice | Rejection:
    """Pick an endpoint for `request`, or say why none: unknown model, no endpoint serving the
    operation, none Ready, all saturated; by the policy `ctx.cfg.policy` names (POLICIES).

    `critical` requests are never rejected for saturation: they go to the least-loaded endpoint."""
    tried = eligible(ctx.endpoints, request, ctx.stats, ctx.now)
    if isinstance(tried, Rejection):
        return tried
    return (ctx.policy or policy_of(ctx.cfg.policy))(_candidates(ctx, tried, request), ctx, request)


def _candidates(ctx: RouteContext, tried: Sequence[EndpointInfo], request: RouteRequest) -> list[_Cand]:
    """Each eligible endpoint with what it holds, whether it is saturated, and its cost for `request`."""
    loads, stats, now, cfg, inflight = ctx.loads, ctx.stats, ctx.now, ctx.cfg, ctx.held
    matched, exact, backlog = ctx.matched, ctx.exact, ctx.backlog
    known = [s.speed for e in tried if (s := stats.get(e.id)) is not None and s.speed is not None]
    best = min(known, key=_DECODE1) if known else None
    cands: list[_Cand] = []
    total, modelled = request.prompt_tokens, cfg.prefill_ms_per_token / 1000.0
    # An engine that has not shown its prefill rate yet is priced as the fastest of its model's endpoints
    # that did, as an unknown speed is: at the configured default (a GPU's 0.1 ms a token) beside
    # siblings that showed 10 ms, the first long prompt went to the unshown one as 100x cheaper.
    rates = [s.prefill for e in tried if (s := stats.get(e.id)) is not None and s.prefill is not None]
    unshown = min(rates) if rates else modelled
    for e in tried:
        n = inflight.get(e.id, 0)
        st = stats.get(e.id)
        load = fresh_load(loads.get(e.id), now, cfg, st.load_seen if st is not None else None)
        ahead = ahead_of(e, load, n, st)
        hard = engine_saturated(load, cfg)
        # Capacity counts what the endpoint holds from everyone (other gateways and gunicorn workers
        # as seen in the scrape, ours exactly), not just this process's in-flight requests.
        soft = bool(e.capacity and ahead >= e.capacity)
        if best is not None and (st is None or st.speed is None) and n >= 1:
            soft = True  # unknown speed while others are known: one probe at a time until it is learned
        if e.id == request.granted:
            soft = False  # a slot another gateway frees for it: the endpoint is full without it
        speed = effective_speed(st, best, now, cfg) or NOTHING_KNOWN
        slots = slots_of(e, st)
        kv = load.kv_usage if load is not None else None
        raw = min(total, matched[e.id] * TOKENS_PER_BLOCK) if matched and e.id in matched else 0.0
        # priced at what that engine was seen to keep of what its index expected
        hit = raw * st.prefix_trust if raw and st is not None and e.id not in exact else raw
        # the endpoint's own prefill rate once its engine showed one (gateway.routing.prefill)
        per_token = (st.prefill if st is not None and st.prefill is not None else unshown) if modelled else 0.0
        if (soft and hit and not hard and e.capacity and e.capacity <= ahead < e.capacity + cfg.max_waiting
                and load is not None and load.waiting is not None and request.queued <= 1):
            # It holds this prompt: the request may wait in its engine's queue, up to the engine's own
            # waiting limit past capacity, when the cost says that still beats a miss elsewhere (the
            # wait for a slot is part of the cost: a hit is traded against queueing). Only where the
            # engine shows its queue: blind, the gateway would pile requests onto it. Never past requests
            # waiting in the gateway's queue (`queued`): a hit sent into the engine's queue takes the
            # next slot there before them, and they waited while later turns went by (fleet A at 95 %
            # in `python -m bench.fleetsim --workload mix`). Priced with the
            # slowdown it brings to the full batch it joins: left out, the queue looked cheaper than
            # the free slots elsewhere by that much, and conversations' turns piled up past capacity
            # in the engine holding their history on fast-prefill engines (`homogeneous` at 80 % in
            # `python -m bench.fleetsim --workload mix`; docs/history.md, 2026-12-04).
            soft, joins = False, True
        else:
            joins = False
        need = (total - hit) * per_token
        # a backlog is the prefill of requests held there: none where nothing is (gateway.routing.backlog)
        behind = backlog.get(e.id, 0.0) if backlog and n else 0.0
        evicts = cfg.evict_weight * st.reuse if st is not None and st.reuse else 0.0
        when_free = 0.0
        if soft and not hard and (need or behind) and not math.isinf(slots):
            free = max(0.0, slots - 1.0)
            when_free = (score(speed, free, slots, e.weight, kv, cfg, need, request.objective, evicts, behind)
                         - score(speed, free, slots, e.weight, kv, cfg, 0.0, request.objective))
        cands.append(_Cand(e, ahead, hard or soft,
                           score(speed, ahead, slots, e.weight, kv, cfg, need, request.objective, evicts, behind,
                                 joins),
                           soft and not hard, speed, slots, raw, hit * per_token, need, behind, when_free))
    return cands


class RoundRobin:
    """A benchmark baseline, as the peers' routers do it: in turn, no saturation, no admission. Its turn
    is its own: one per router, moved on by every choice it makes."""

    __slots__ = ("turn",)

    def __init__(self, turn: int = 0):
        self.turn = turn

    def __call__(self, cands: list[_Cand], ctx: RouteContext, request: RouteRequest) -> Choice | Rejection:
        cands.sort(key=lambda c: c.ep.id)
        c = cands[self.turn % len(cands)]
        self.turn += 1
        return Choice(c.ep, c.score, c.ahead, c.saturated, "round_robin")


def _least_inflight(cands: list[_Cand], ctx: RouteContext, request: RouteRequest) -> Choice | Rejection:
    """A benchmark baseline: the fewest requests held (ties at random), no saturation, no admission."""
    low = min(c.ahead for c in cands)
    c = ctx.rng.choice([c for c in cands if c.ahead == low])
    return Choice(c.ep, c.score, c.ahead, c.saturated, "least_inflight")


def _llmgw(cands: list[_Cand], ctx: RouteContext, request: RouteRequest) -> Choice | Rejection:
    """llmgw's policy: the cheapest open endpoint of the highest tier with room (module docstring)."""
    if request.slo is not None:
        return _with_targets(cands, ctx, request, request.slo)
    rng, cfg = ctx.rng, ctx.cfg
    # Highest priority tier with room takes the request; lower tiers take the overflow.
    for prio in sorted({c.ep.priority for c in cands}, reverse=True):
        tier = [c for c in cands if c.ep.priority == prio]
        open_ = [c for c in tier if not c.saturated]
        if not open_:
            continue
        if request.priority == "standard":
            wait = _better_to_wait(tier, open_, request, cfg)
            if wait is not None:
                return Rejection("saturated", request.model, "deferred: a faster endpoint frees sooner", wait)
        picked = _pick(open_, request, rng, cfg, "tier %d" % prio)
        if request.prefix and len(open_) > 1:
            nxt = min((c for c in open_ if c.ep is not picked.endpoint), key=lambda c: c.score)
            picked = replace(picked, runner_up=(nxt.ep.id, nxt.score, nxt.matched))
        return picked
    if request.priority == "critical":
        best_c = min(cands, key=lambda c: c.score)
        return _choice(best_c, True, "critical past saturation", cfg, request)
    return Rejection("saturated", request.model, f"all {len(cands)} endpoints saturated")


def _with_targets(cands: list[_Cand], ctx: RouteContext, request: RouteRequest, slo: Slo) -> Choice | Rejection:
    """llmgw's policy for a request with latency targets: among the open endpoints of the highest tier
    that has one predicted to meet them (`predict`, `lateness`), as usual; a lax request (more than
    `slo_lax` seconds to spare there) leaves the model's last `slo_reserve` free slots to the requests
    that will need them, and waits in the queue instead while it can. When no open endpoint will meet
    them, a strict request is refused (MISSES, with the predicted time) and any other goes where the
    miss is smallest. When every endpoint is saturated it waits (admission's, gateway.routing.slo), told
    the first byte it would get once a slot frees."""
    rng, cfg, waited = ctx.rng, ctx.cfg, request.waited
    nearest: tuple[float, _Cand, tuple | None] | None = None  # (lateness, candidate, prediction)
    for prio in sorted({c.ep.priority for c in cands}, reverse=True):
        tier = [c for c in cands if c.ep.priority == prio]
        open_ = [c for c in tier if not c.saturated]
        if not open_:
            continue
        meeting = []
        for c in open_:
            p = predict(c)
            late = lateness(p, slo, waited)
            if late <= 0.0:
                meeting.append((c, p))
            elif nearest is None or late < nearest[0]:
                nearest = (late, c, p)
        if not meeting:
            continue
        if cfg.slo_reserve > 0 and request.priority == "standard":  # (the others are not queued to wait)
            left = min(spare(p, slo, waited) for _, p in meeting)
            if left > cfg.slo_lax:
                free = sum(c.slots - c.ahead for c in open_ if not math.isinf(c.slots))
                if free - 1.0 < cfg.slo_reserve and len(open_) == sum(not math.isinf(c.slots) for c in open_):
                    return Rejection("saturated", request.model, "deferred: a lax request leaves the last free slots "
                                     "to tight ones", left - cfg.slo_lax)
        if request.priority == "standard" and slo.ttft is None:  # only a request without a first-byte target
            wait = _better_to_wait(tier, [c for c, _ in meeting], request, cfg)  # waits for a faster endpoint
            if wait is not None:
                return Rejection("saturated", request.model, "deferred: a faster endpoint frees sooner", wait)
        return _pick([c for c, _ in meeting], request, rng, cfg, "tier %d, meets its targets" % prio)
    if nearest is not None:
        late, c, p = nearest
        if slo.strict:
            first = (p[0] if slo.stream else p[2]) if p is not None else 0.0
            return Rejection(MISSES, request.model, f"no endpoint is predicted to meet its targets: the nearest, "
                             f"{c.ep.id}, {_missed_by(p, slo, waited)}", predicted=first)
        return _choice(c, False, "tier %d, the least miss of its targets" % c.ep.priority, cfg, request)
    if request.priority == "critical":
        best_c = min(cands, key=lambda c: c.score)
        return _choice(best_c, True, "critical past saturation", cfg, request)
    firsts = [c.speed.ttfb + c.prefill + (0.0 if slo.stream else c.speed.decode(c.slots))
              for c in cands if c.speed is not NOTHING_KNOWN and not math.isinf(c.slots)]
    return Rejection("saturated", request.model, f"all {len(cands)} endpoints saturated",
                     predicted=min(firsts) if firsts else None)


def _missed_by(p: tuple[float, float | None, float] | None, slo: Slo, waited: float) -> str:
    """What an endpoint's prediction misses of a request's targets, in words."""
    if p is None:
        return "is not learned yet"
    parts = []
    first = p[0] if slo.stream else p[2]
    if slo.ttft is not None and first > slo.ttft - waited:
        parts.append(f"its first byte in {_ms(waited + first)} (target {_ms(slo.ttft)})")
    if slo.tpot is not None and p[1] is not None and p[1] > slo.tpot:
        parts.append(f"{_ms(p[1])} per token (target {_ms(slo.tpot)})")
    if slo.total is not None and p[2] > slo.total - waited:
        parts.append(f"the whole answer in {_ms(waited + p[2])} (deadline {_ms(slo.total)})")
    return "predicts " + ", ".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


# A policy picks among the candidates of one request.
Policy = Callable[[list[_Cand], RouteContext, RouteRequest], Choice | Rejection]
# Routing policies by name (`LLMGW_GATEWAY_POLICY`), each a maker of one router's instance: llmgw's, and
# the benchmark baselines that stand for the peers' routers.
POLICIES: dict[str, Callable[[], Policy]] = {
    "llmgw": lambda: _llmgw,
    "round_robin": RoundRobin,
    "least_inflight": lambda: _least_inflight,
}


def policy_of(name: str) -> Policy:
    """A new instance of the policy `name` (`LLMGW_GATEWAY_POLICY`)."""
    return POLICIES[name]()


def _better_to_wait(tier: list[_Cand], open_: list[_Cand], request: RouteRequest,
                    cfg: RoutingConfig) -> float | None:
    """Whether waiting in the gateway's queue for a full (by capacity) endpoint beats the best open
    one by `wait_margin`: None if not, else the seconds until it no longer does with no endpoint
    freeing meanwhile (inf: never). The request at queue position `queued` gets a slot once that
    many requests have finished on the full endpoints that would serve it better (each completes
    `slots` per full batch), then runs in a full batch there."""
    full = [c for c in tier if c.soft and not math.isinf(c.slots)]
    if not full:
        return None
    best_open = min(c.score for c in open_)
    # What a full endpoint gives once a slot frees there: the whole answer, or only its first token
    # (a streamed request is held only when even that comes sooner than on the open endpoint).
    # Both with the prompt's own terms there (its prefill less what that engine holds, the batch it
    # stalls, the backlog), as the open endpoints' scores have them: without them a long prompt that
    # no endpoint holds was held for a full endpoint, as if it would start there with nothing to
    # compute, and waited there a whole answer's time (bench/prefix.py's TTFT tail).
    if request.objective == FIRST_TOKEN:
        served = [(c, c.speed.ttfb + c.prompt_when_free) for c in full]
    else:
        served = [(c, c.speed.ttfb + c.speed.decode(c.slots) + c.prompt_when_free) for c in full]
    better = [(c, t) for c, t in served if t < best_open]
    if not better:
        return None
    rate = sum(c.speed.rate(c.slots) for c, _ in better)
    serve = sum(c.speed.rate(c.slots) * t for c, t in better) / rate
    waited, ahead, m = request.waited, max(1, request.queued) / rate + serve, cfg.wait_margin
    if (waited + ahead) * m >= waited + best_open:
        return None
    # (w + ahead) * m < w + best_open holds until w = (best_open - ahead * m) / (m - 1), for m > 1.
    return (best_open - ahead * m) / (m - 1) - waited if m > 1 else math.inf


def fleet_rate(endpoints: Sequence[EndpointInfo], stats: Mapping[str, EndpointStats], model: str) -> float | None:
    """Requests per second the model's endpoints complete with full batches, by what was learned;
    None when an endpoint's speed or batch limit is unknown (the rate cannot be bounded)."""
    total = 0.0
    for e in endpoints:
        if model not in e.models:
            continue
        st = stats.get(e.id)
        slots = slots_of(e, st)
        if st is None or st.speed is None or math.isinf(slots):
            return None
        total += st.speed.rate(slots)
    return total or None


def _pick(tier: list[_Cand], request: RouteRequest, rng: random.Random, cfg: RoutingConfig, why: str) -> Choice:
    if request.affinity:
        mean = sum(c.ahead for c in tier) / len(tier)
        bound = cfg.affinity_load_factor * mean + 1
        for c in sorted(tier, key=lambda c: _rendezvous(request.affinity, c.ep.id), reverse=True):
            if c.ahead <= bound:
                return _choice(c, False, why + ", affinity", cfg, request)
    if request.prefix and any(c.matched for c in tier):
        # A request whose history an endpoint holds goes by cost alone, with no bound on load: the
        # wait for a slot there, the prefill queued there (gateway.routing.backlog) and the engine's
        # own saturation are in the cost or the candidates already, and a move loses that history.
        # One that opens a conversation matches only a shared head (a system prompt): a miss costs
        # that head once, after which two endpoints hold it, while where it goes is where all its
        # later turns will stay. So it is placed with bounded load, as sessions are: an endpoint
        # holding more than `affinity_load_factor` times the tier's mean, plus one, takes it only
        # when every endpoint does. (A bound on every request moved later turns off the engines
        # holding their history; none at all let one engine take far more than its share:
        # `python -m bench.prefix` prints both, docs/history.md has the runs.)
        if request.opens:
            bound = cfg.affinity_load_factor * sum(c.ahead for c in tier) / len(tier) + 1
            tier = [c for c in tier if c.ahead <= bound] or tier
    elif request.prefix:
        # Nobody here was sent this prompt's head: place it by rendezvous hashing of the head among
        # the endpoints whose cost is within `placement_band` of the best (load-bounded, and a
        # slow engine is not picked for a hash), so every gateway process, each with its own index,
        # puts a new system prompt on the same replica and its later requests find it there.
        head = _head(request.prefix)
        low = min(c.score for c in tier)
        within = [c for c in tier if c.score <= low * cfg.placement_band]
        return _choice(max(within, key=lambda c: _rendezvous(head, c.ep.id)), False, why + ", prefix placed", cfg,
                       request)
    low = min(c.score for c in tier)
    near = [c for c in tier if c.score <= low * (1 + cfg.tie_tolerance)]
    if len(near) == 1:
        return _choice(near[0], False, why, cfg, request)
    if request.prefix:
        # Near-ties broken by the prompt's leading blocks, the same way in every gateway process:
        # gateways that have not seen a conversation yet still send its turns (and every prompt
        # sharing its head) to one replica, while it stays within the band of the best cost.
        head = _head(request.prefix)
        return _choice(max(near, key=lambda c: _rendezvous(head, c.ep.id)), False, why + ", prefix tie", cfg,
                       request)
    return _choice(rng.choice(near), False, why, cfg, request)


def _head(keys: tuple[int, ...]) -> str:
    """The key naming a prompt's head for the tie-break: its fourth block (256 bytes, past a common
    preamble such as "You are a helpful assistant"), or its last when shorter."""
    return str(keys[min(len(keys), HEAD_BLOCKS) - 1])


HEAD_BLOCKS = 4


def predict(c: _Cand) -> tuple[float, float | None, float] | None:
    """What a request sent to candidate `c` now is predicted to get, in seconds: its first token (the
    wait for a slot when the batch is full, the prefill queued there before it, its own prefill of
    what the engine is not expected to hold, the engine's time to first byte: the network and a
    step), its time per token after the first (the decode step at the batch size once it joins; None
    while the tokens per answer are unknown) and its whole answer. The terms of `score` without its
    weights: what `choose` already computes. None while the endpoint's speed is unknown."""
    sp = c.speed
    if sp is NOTHING_KNOWN:
        return None
    held, slots = c.ahead, c.slots
    first = sp.first_token(held, slots)
    if c.behind:
        first += c.behind if held + 1.0 <= slots else max(0.0, c.behind - (first - sp.ttfb))
    first += c.prefill
    batch = held + 1.0 if held + 1.0 <= slots else slots
    return first, (sp.tpot(held, slots) or None), first + sp.decode1 * (1.0 + sp.slowdown * (batch - 1.0))


def _choice(c: _Cand, saturated: bool, why: str, cfg: RoutingConfig, request: RouteRequest) -> Choice:
    p = predict(c)
    if p is None:
        return Choice(c.ep, c.score, c.ahead, saturated, why, "", c.matched, c.saved, request.prompt_tokens,
                      prefill=c.prefill, behind=c.behind, waited=request.waited)
    return Choice(c.ep, c.score, c.ahead, saturated, why, "", c.matched, c.saved, request.prompt_tokens,
                  prefill=c.prefill, behind=c.behind, waited=request.waited, predicted_ttft=p[0],
                  predicted_tpot=p[1], predicted_total=p[2])
