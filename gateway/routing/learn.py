"""How fast each endpoint serves, learned from what the gateway sees. Pure: each function returns new
values (`fit = update(fit, sample)`), never changes its arguments.

Samples (gateway.routing.speed fits them):
- per-token times from two consecutive LoadRecords' token counters (`learn_scrape`);
- once per finished request (`answer_sample`, taken on the request path; `learn_answer`, folded in
  on the next load refresh): its decode time (elapsed minus time to first byte) at the concurrency
  it ran in, its tokens per second when the answer reported usage, and its time to first byte when
  it found a free slot. Nothing is measured per chunk.

`observe_loads` is one load refresh: the answers since the last one, the new LoadRecords (what we
held at each scrape, the engine's batch limit, the other gateways' share), then every endpoint's
`Speed`, the endpoints of a model pulled together as far as their samples cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, NamedTuple, Sequence

from gateway.config import RoutingConfig
from gateway.routing.inflight import Answer, model_of
from gateway.routing.load import NO_STATS, EndpointStats, ahead_of, fresh_load, slots_of
from gateway.routing.prefill import prefill_seen, reuse_seen
from gateway.routing.speed import Fit, Speed, shrink
from llmgw.state.records import EndpointInfo, LoadRecord

EWMA_ALPHA = 0.25  # time to first byte, per endpoint
TOKENS_ALPHA = 0.05  # tokens per answer, fleet-wide
PROMPT_WORK_MAX = 0.5  # seconds of predicted prompt work past which an answer teaches no first byte


class Learned(NamedTuple):
    """The samples behind one endpoint's Speed."""

    per_token: Fit = Fit()  # seconds per token per stream vs concurrency (scrapes; answers with usage)
    per_request: Fit = Fit()  # decode seconds per answer vs concurrency (every answer)
    ttfb: float | None = None  # smoothed time to first byte of requests that found a free slot
    last: float = 0.0  # when the last sample came (the router's monotonic clock)


class Tokens(NamedTuple):
    """Completion tokens per answer, fleet-wide: from usage, smoothed ...

    ... and, while no answer reports usage, as implied by decode times and per-token speeds."""

    reported: float | None = None
    estimate: float | None = None


@dataclass(frozen=True)
class Learning:
    """Everything the learner holds between load refreshes."""

    learned: Mapping[str, Learned] = field(default_factory=dict)
    tokens: Tokens = Tokens()

    def keep(self, listed: Mapping[str, EndpointInfo]) -> "Learning":
        return Learning({k: v for k, v in self.learned.items() if k in listed}, self.tokens)


def first_byte_sample(ttfb: float | None, prompt_work: float) -> float | None:
    """The time to first byte an answer teaches, or None: the engine's own (a step, the network).
    `prompt_work` is the prefill seconds `choose` predicted for the request there (its own prompt
    and the backlog it waited behind): the cost adds that by itself, so it comes off, and an engine
    that was sent more misses does not look slower to every later request. Past PROMPT_WORK_MAX it
    teaches nothing (`answer_sample`)."""
    if ttfb is None or prompt_work > PROMPT_WORK_MAX:
        return None
    return max(0.0, ttfb - prompt_work)


def answer_sample(ep: EndpointInfo, ahead: int, held: int, elapsed: float, tokens: int | None, ttfb: float | None,
                  rec: LoadRecord | None, st: EndpointStats | None, now: float, cfg: RoutingConfig,
                  prompt_work: float = 0.0) -> Answer | None:
    """A finished request on `ep`, sent with `ahead` requests before it and ending with `held` on
    the endpoint (ours and the sibling workers'): the concurrency it ran in is the mean of the two.
    `ttfb` is its first byte as measured (a stream's; None for a whole answer), `prompt_work` the
    prefill seconds `choose` predicted for it there.

    Its decode time is what followed its first byte; a whole answer's, its time less that predicted
    prompt work. A whole answer predicted to spend more than PROMPT_WORK_MAX on its prompt teaches
    nothing (None), nor does its first byte teach one then, nor either of them while its engine's
    counters have not shown its prefill rate yet (`unshown_prefill`: the prediction was the default's
    guess: in a clean-clone run of the suite, a vLLM replica that had only answered short prompts was
    predicted at 1.7 s for a 1,337-token prompt's whole answer, its prefill priced at the default 0.1 ms
    a token, and then above 20 s for the conversation's next turn, dearer than prefilling all of it
    again on the other replica: that prompt's seconds of prefill learned as decode, as inferred from
    the two predictions): what is left is mostly the error of that
    prediction, not the engine's step or decode. On a busy machine (CI's, running the other half of
    the suite) a conversation's next turn left the vLLM replica holding its 1,337-token history for
    one predicted to prefill all of it for 14 s (tests/e2e/test_vllm_cpu.py): the history's first,
    whole answer, predicted at 10 s and slower there, was learned as six tokens' decode, the one term
    of the holder's cost that a single answer moves that far (the learner's state was not logged;
    tests/unit/test_gateway_learning.py has the case). The prefill rate is learned from the engine's
    own counters instead (gateway.routing.prefill)."""
    slots = slots_of(ep, st)
    load = fresh_load(rec, now, cfg, st.load_seen if st is not None else None)
    conc = min(slots, max(1.0, (ahead + 1 + ahead_of(ep, load, held, st)) / 2))
    # The prompt work is a guess until the engine's counters showed its prefill rate: the default
    # (LLMGW_GATEWAY_PREFILL_MS_PER_TOKEN, a GPU's) stood in, and on a CPU replica the real prefill
    # was a hundred times that. What the answer took beyond its first byte is still its decode.
    guessed = prompt_work > 0 and unshown_prefill(rec, st)
    if ttfb is not None and 0 <= ttfb < elapsed:
        decode = elapsed - ttfb
    elif prompt_work > PROMPT_WORK_MAX or guessed:
        return None
    else:
        decode = max(0.0, elapsed - prompt_work)
    first = first_byte_sample(ttfb, prompt_work) if ahead + 1 <= slots and not guessed else None
    return Answer(ep.id, now, conc, decode, tokens, first)


def unshown_prefill(rec: LoadRecord | None, st: EndpointStats | None) -> bool:
    """The endpoint's engine counts its prefill (gateway.routing.prefill), but its counters have not
    shown a rate yet. An engine that does not count it at all (an external endpoint) is priced at
    the default for good, and its answers teach as ever."""
    return rec is not None and rec.prefill_seconds_total is not None and (st is None or st.prefill is None)


def learn_answer(lr: Learned | None, tokens: Tokens, a: Answer, half_life: float) -> tuple[Learned, Tokens]:
    """The endpoint's samples and the fleet's tokens per answer after one more answer."""
    lr = lr or Learned()
    per_token = lr.per_token
    if a.tokens:
        t = tokens.reported
        tokens = tokens._replace(reported=a.tokens if t is None else t + TOKENS_ALPHA * (a.tokens - t))
        per_token = per_token.add(a.concurrency, a.decode / max(1, a.tokens - 1), a.at, half_life)
    elif (line := per_token.line()) is not None:
        implied = 1 + a.decode / (line[0] * (1 + line[1] * (a.concurrency - 1)))
        t = tokens.estimate
        tokens = tokens._replace(estimate=implied if t is None else t + TOKENS_ALPHA * (implied - t))
    ttfb = lr.ttfb
    if a.ttfb is not None:
        ttfb = a.ttfb if ttfb is None else ttfb + EWMA_ALPHA * (a.ttfb - ttfb)
    return Learned(per_token, lr.per_request.add(a.concurrency, a.decode, a.at, half_life), ttfb, a.at), tokens


def fold_answers(state: Learning, answers: Sequence[Answer], half_life: float) -> Learning:
    """The learner after `answers`, in the order they ended."""
    if not answers:
        return state
    learned, tokens = dict(state.learned), state.tokens
    for a in answers:
        learned[a.endpoint], tokens = learn_answer(learned.get(a.endpoint), tokens, a, half_life)
    return Learning(learned, tokens)


def learn_scrape(lr: Learned | None, old: LoadRecord | None, rec: LoadRecord, now: float,
                 half_life: float) -> Learned | None:
    """Seconds per token per running sequence between two scrapes, at the mean running count; None
    when the two teach nothing."""
    if (old is None or not (old.ok and rec.ok) or old.generation_tokens_total is None
            or rec.generation_tokens_total is None):
        return None
    dt = rec.ts - old.ts
    dgen = rec.generation_tokens_total - old.generation_tokens_total
    # Only an engine busy at both ends, with more than one sequence, was likely busy all along:
    # otherwise the mean running count says nothing about how long it worked for its tokens
    # (one request ending and the next arriving later looks like a slow engine).
    if dt <= 0 or dgen <= 0 or (old.running or 0) < 2 or (rec.running or 0) < 2:
        return None
    running = (old.running + rec.running) / 2
    lr = lr or Learned()
    return lr._replace(per_token=lr.per_token.add(running, running * dt / dgen, now, half_life), last=now)


def slots_seen(old: LoadRecord | None, rec: LoadRecord, prev: int | None, most: int = 0) -> int | None:
    """The engine's batch limit: the running count while requests waited in it, in two scrapes in a
    row (a single scrape may catch a request between its arrival and the next engine step); and
    never less than `most`, the most it was ever seen running at once (this scrape included).

    Requests wait for other reasons than a full batch: a long prompt's prefill (vLLM works through
    it in chunks of its token budget while newer requests wait; the sim engine's prefill step holds
    arrivals until it ends), or a KV cache too full for the next prompt. Such a wait once taught a
    limit of 1 on an engine of 8 slots, which then looked saturated by one request and was starved
    of the traffic that would have shown it runs more: so a scrape showing more running than the
    limit learned raises it. And a wait with 2 running on an engine that had been seen running 8
    taught a limit of 2, as the floor was only kept once a limit had been learned: the router then
    took that engine's free slots for a queue and queued conversations' turns past capacity in
    the engine holding their history instead (bench/fleetsim.py `--workload mix` on `homogeneous`)."""
    if prev is not None and most > prev:
        prev = most
    if (old is not None and old.ok and rec.ok and (old.waiting or 0) > 0 and (rec.waiting or 0) > 0
            and old.running and rec.running):
        return max(prev or 0, most, int(min(old.running, rec.running)))
    return prev


def others_ratio(loads: Mapping[str, LoadRecord], stats: Mapping[str, EndpointStats],
                 listed: Mapping[str, EndpointInfo]) -> dict[str, EndpointStats]:
    """Per model, how many requests the other gateways had on its endpoints per one of ours at the
    last scrapes (load.ahead_of extrapolates their growth since with it)."""
    held: dict[str, list[float]] = {}  # model -> [ours, others]
    for i, rec in loads.items():
        st, ep = stats.get(i), listed.get(i)
        if st is None or ep is None or st.scrape_inflight is None or not rec.ok:
            continue
        acc = held.setdefault(model_of(ep), [0.0, 0.0])
        acc[0] += st.scrape_inflight
        acc[1] += max(0.0, (rec.running or 0) + (rec.waiting or 0) - st.scrape_inflight)
    out = dict(stats)
    for i, st in stats.items():
        ep = listed.get(i)
        acc = held.get(model_of(ep)) if ep is not None else None
        ratio = acc[1] / acc[0] if acc and acc[0] > 0 else 0.0
        if ratio != st.others_ratio:
            out[i] = replace(st, others_ratio=ratio)
    return out


def speed_of(lr: Learned, tokens: float | None) -> tuple[Speed, float] | None:
    """A typical answer's speed, and its relative error: per-token times x tokens per answer, and
    the answers' own decode times, averaged by how precise each is."""
    lines = []  # (precision, decode1, slowdown)
    if tokens and (line := lr.per_token.line()) is not None:
        lines.append((max(lr.per_token.error(), 1e-3) ** -2, tokens * line[0], line[1]))
    if (line := lr.per_request.line()) is not None:
        lines.append((max(lr.per_request.error(), 1e-3) ** -2, line[0], line[1]))
    if not lines:
        return None
    w = sum(x[0] for x in lines)
    d1 = sum(x[0] * x[1] for x in lines) / w
    # per token after the first, as the per-token samples are (decode / (tokens - 1))
    per_token = d1 / (tokens - 1.0) if tokens and tokens > 1.0 else 0.0
    speed = Speed(d1, sum(x[0] * x[2] for x in lines) / w, lr.ttfb or 0.0, per_token)
    return speed, w ** -0.5


def derive_speeds(state: Learning, stats: Mapping[str, EndpointStats],
                  listed: Mapping[str, EndpointInfo]) -> dict[str, EndpointStats]:
    """Every endpoint's Speed from its samples (the fleet's tokens per answer may have moved too),
    the endpoints of each model pulled together as far as their samples cannot tell them apart."""
    tokens = state.tokens.reported or state.tokens.estimate
    raw = {i: est for i, lr in state.learned.items() if (est := speed_of(lr, tokens)) is not None}
    groups: dict[str, list[str]] = {}
    for i in raw:
        ep = listed.get(i)
        groups.setdefault(model_of(ep) if ep is not None else i, []).append(i)
    out = dict(stats)
    for ids in groups.values():
        for i, speed in zip(ids, shrink([raw[i] for i in ids])):
            st, lr = out.get(i, NO_STATS), state.learned[i]
            if speed != st.speed or lr.last != st.last_sample:
                out[i] = replace(st, speed=speed, last_sample=lr.last)
    return out


def observe_loads(state: Learning, loads: Mapping[str, LoadRecord], before: Mapping[str, LoadRecord],
                  stats: Mapping[str, EndpointStats], held: Mapping[str, int], answers: Sequence[Answer],
                  listed: Mapping[str, EndpointInfo], seen: float, cfg: RoutingConfig
                  ) -> tuple[Learning, dict[str, EndpointStats]]:
    """One load refresh: the learner and the stats after the `answers` since the last one and the
    new `loads` (`before`: the records they replace; `held`: what this gateway held at each new
    record's scrape; `seen`: now, when this gateway first saw them)."""
    state = fold_answers(state, answers, cfg.learn_half_life)
    learned, out = dict(state.learned), dict(stats)
    for i, rec in loads.items():
        if is_new(i, rec, before):
            old, prev = before.get(i), out.get(i)
            since = prev.prefill_since if prev is not None and prev.prefill_since is not None else old
            prefill, since = prefill_seen(since, rec, prev.prefill if prev is not None else None)
            most = max(prev.most_running if prev is not None else 0, int(rec.running or 0) if rec.ok else 0)
            out[i] = replace(prev or NO_STATS, scrape_inflight=held[i], load_seen=seen, most_running=most,
                             slots=slots_seen(old, rec, prev.slots if prev is not None else None, most),
                             prefill=prefill, prefill_since=since,
                             reuse=reuse_seen(old, rec, prev.reuse if prev is not None else None))
            lr = learn_scrape(learned.get(i), old, rec, seen, cfg.learn_half_life)
            if lr is not None:
                learned[i] = lr
    state = Learning(learned, state.tokens)
    return state, derive_speeds(state, others_ratio(loads, out, listed), listed)


def is_new(i: str, rec: LoadRecord, before: Mapping[str, LoadRecord]) -> bool:
    """Endpoint `i`'s record is one this gateway has not seen yet (another `ts` than the one it holds)."""
    old = before.get(i)
    return old is None or old.ts != rec.ts
