"""What the router learns per endpoint (gateway.routing.learn, pure): from two scrapes (per-token time,
batch limit) and once per finished request (decode time, tokens), and the speeds it derives on each
load refresh."""

import pytest

from gateway.config import GatewaySettings
from gateway.routing.choice import Choice
from llmgw.state.records import EndpointInfo, LoadRecord
from llmgw.state.store import CatalogOutline
from tests.support.clock import FakeClock
from tests.support.routers import polled


class Store:
    """What the Pollers read: the endpoint list, the loads, and no catalog."""

    def __init__(self, eps):
        self.eps, self.records = eps, {}

    def catalog_outline(self):  # no catalog
        return CatalogOutline()

    def key_variables(self):
        return []

    def endpoints_version(self):
        return 1

    def read_endpoints(self):
        return 1, "fp", list(self.eps)

    def loads(self, ids):
        return {i: self.records[i] for i in ids if i in self.records}


def ep(i, model="m", capacity=8):
    return EndpointInfo(id=i, url=f"http://{i}", models=(model,), engine="sim", model=model, capacity=capacity)


def setup(*eps):
    clock = FakeClock()
    st, polls = polled(Store(list(eps)), GatewaySettings(seed=1), clock)
    polls.refresh_endpoints()
    return st, polls, clock


def scrape(polls, clock, i, running, waiting, gen):
    clock.advance(1.0)
    polls.store.records[i] = LoadRecord(i, clock.t, True, running=running, waiting=waiting, generation_tokens_total=gen)
    polls.refresh_loads()


def test_per_token_time_from_an_engine_busy_between_two_scrapes():
    st, polls, clock = setup(ep("a"))
    scrape(polls, clock, "a", 4, 0, 1000)
    scrape(polls, clock, "a", 4, 0, 1200)  # 200 tokens in 1 s over 4 sequences: 20 ms per token
    f = st.learning.learned["a"].per_token
    assert f.w == 1 and f.sx == 4 and f.sy == pytest.approx(0.020)


def test_an_engine_idle_at_either_end_teaches_nothing():
    """One request ending and the next arriving later looks like a slow engine: 5 tokens in 1 s with
    one running at both ends may be 20 ms of work. Such intervals are skipped (this once stuck a
    half-speed engine at three times its real decode time, so it got no traffic)."""
    st, polls, clock = setup(ep("a"))
    for running, gen in ((1, 0), (1, 5), (0, 64), (3, 70), (1, 80)):
        scrape(polls, clock, "a", running, 0, gen)
    assert "a" not in st.learning.learned


def test_batch_limit_seen_while_requests_wait_in_two_scrapes_in_a_row():
    st, polls, clock = setup(ep("a", capacity=None))
    scrape(polls, clock, "a", 3, 1, 0)  # a request between arrival and the next step: not a limit
    scrape(polls, clock, "a", 5, 0, 100)
    assert st.stats["a"].slots is None
    scrape(polls, clock, "a", 6, 2, 200)
    scrape(polls, clock, "a", 6, 3, 300)
    assert st.stats["a"].slots == 6


def test_a_batch_limit_learned_too_low_is_raised_by_what_the_engine_runs():
    """A long prefill holds newer requests waiting with one running, two scrapes in a row: that
    looks like a limit of 1. The next scrape with more running at once shows it was not one."""
    st, polls, clock = setup(ep("a", capacity=None))
    scrape(polls, clock, "a", 1, 2, 0)
    scrape(polls, clock, "a", 1, 3, 0)
    assert st.stats["a"].slots == 1
    scrape(polls, clock, "a", 4, 0, 60)
    assert st.stats["a"].slots == 4
    scrape(polls, clock, "a", 2, 0, 100)  # fewer running later teaches nothing
    assert st.stats["a"].slots == 4


def test_a_wait_never_teaches_a_limit_below_what_the_engine_was_seen_running():
    """An engine seen running 8 at once, later two scrapes with 2 running while a long prefill holds
    a request waiting: its limit is 8, not 2. Before, the most seen running was kept only once a
    limit had been learned, so the first wait taught 2, and the router took its free slots for a
    queue."""
    st, polls, clock = setup(ep("a", capacity=8))
    scrape(polls, clock, "a", 8, 0, 0)
    scrape(polls, clock, "a", 5, 0, 100)
    assert st.stats["a"].slots is None and st.stats["a"].most_running == 8
    scrape(polls, clock, "a", 2, 1, 200)
    scrape(polls, clock, "a", 2, 1, 300)
    assert st.stats["a"].slots == 8


def test_the_time_to_first_byte_is_learned_net_of_the_prompt_work_the_cost_adds_itself():
    """A request that prefilled 2,000 tokens there (0.2 s at the default 0.1 ms a token) and answered
    its first byte after 0.25 s teaches a time to first byte of 0.05 s: else an engine that was sent
    the misses would look slower to every later request, on top of their own prefill."""
    from gateway.routing.choice import RouteRequest
    from gateway.routing.prefixkeys import prefix_of
    from llmgw.surface import CHAT

    st, polls, clock = setup(ep("a"))
    keys, tokens = prefix_of({"messages": [{"role": "user", "content": "word " * 1600}]}, CHAT, "m")
    c = st.route(RouteRequest("m", prefix=keys, prompt_tokens=tokens))
    assert c.prefill == pytest.approx(tokens * 0.0001) and c.behind == 0
    hit = st.route(RouteRequest("m", prefix=keys, prompt_tokens=tokens))  # at once: behind the first's prefill
    assert hit.prefill == pytest.approx(0, abs=0.001) and hit.behind == pytest.approx(c.prefill)
    st.release(c, 1.25, 51, c.prefill + 0.05)
    st.release(hit, 1.1, 51, hit.prefill + hit.behind + 0.05)
    clock.advance(2.0)  # the backlog drained
    other = st.route(RouteRequest("m", prefix=keys[:1] + (7,), prompt_tokens=tokens))
    assert other.behind == 0 and other.prefill > 0.19
    st.release(other, 1.5, 51, other.prefill + 0.05)
    assert st.learning.learned["a"].ttfb == pytest.approx(0.05)


def test_an_answer_whose_prompt_work_was_long_teaches_neither_its_decode_nor_its_first_byte():
    """Two replicas answer alike; one then answers a whole (non-streamed) request whose 1,300-token
    prompt was predicted at 10 s and took 30 s on a busy machine. Its time is mostly that prompt's,
    whose prediction was off: learned as six tokens' decode it priced the replica holding a
    conversation's history above one that would compute it all again (CI's vLLM run). It teaches
    nothing; a short prompt's whole answer teaches its time less the predicted prompt work."""
    st, polls, clock = setup(ep("a"), ep("b"))
    for c in (ep("a"), ep("b")):
        for _ in range(4):
            st.release(Choice(c, 0.0, 0), 1.1, 51, 0.1)
    scrape(polls, clock, "a", 0, 0, 0)
    before = st.learning.learned["a"]
    st.release(Choice(ep("a"), 0.0, 0, prefill=10.0), 30.0, 6, None)  # whole answer: no first byte seen
    st.release(Choice(ep("a"), 0.0, 0, prefill=9.0, behind=1.0), 31.0, 6, 29.0)  # a stream's: its decode only
    scrape(polls, clock, "a", 0, 0, 0)
    after = st.learning.learned["a"]
    assert after.ttfb == pytest.approx(before.ttfb)  # 29 s less 10 s predicted is no first step
    assert after.per_request.sy / after.per_request.w < 1.5  # the stream's 2 s after its first byte, not 30 s
    assert st.stats["a"].speed.decode1 < 1.5 * st.stats["b"].speed.decode1


def test_a_whole_answers_decode_is_its_time_less_the_predicted_prompt_work():
    from gateway.config import RoutingConfig
    from gateway.routing.learn import PROMPT_WORK_MAX, answer_sample

    cfg, a = RoutingConfig(), ep("a")
    whole = answer_sample(a, 0, 1, 1.4, 51, None, None, None, 0.0, cfg, prompt_work=0.3)
    assert whole.decode == pytest.approx(1.1) and whole.ttfb is None
    streamed = answer_sample(a, 0, 1, 1.4, 51, 0.35, None, None, 0.0, cfg, prompt_work=0.3)
    assert streamed.decode == pytest.approx(1.05) and streamed.ttfb == pytest.approx(0.05)
    assert answer_sample(a, 0, 1, 30.0, 6, None, None, None, 0.0, cfg, prompt_work=PROMPT_WORK_MAX + 0.1) is None
    long_stream = answer_sample(a, 0, 1, 31.0, 6, 29.0, None, None, 0.0, cfg, prompt_work=10.0)
    assert long_stream.decode == pytest.approx(2.0) and long_stream.ttfb is None


def test_each_answer_is_learned_once_at_its_end():
    st, polls, clock = setup(ep("a"), ep("b"))
    for _ in range(4):
        c = st.route(st_req())
        # 1.1 s in all, the first byte after 0.1 s: 1.0 s of decoding; 51 tokens: 20 ms per token
        st.release(c, 1.1, 51, 0.1)
    lr = st.learning.learned[c.endpoint.id]
    assert lr.per_request.sy / lr.per_request.w == pytest.approx(1.0)
    assert lr.per_token.sy / lr.per_token.w == pytest.approx(0.020)
    assert lr.ttfb == pytest.approx(0.1) and st.learning.tokens.reported == pytest.approx(51)
    assert st.inflight == {c.endpoint.id: 0}
    # a failed request (no service time) frees its slot and teaches nothing
    c = st.route(st_req())
    st.release(c, None)
    assert st.inflight[c.endpoint.id] == 0


def test_tokens_per_answer_are_inferred_when_answers_do_not_report_usage():
    st, polls, clock = setup(ep("a"))
    for i in range(4):  # the engine's counters: 20 ms per token at 4 running
        scrape(polls, clock, "a", 4, 0, 200 * i)
    c = st.route(st_req())
    st.release(c, 1.3, None, 0.02)  # no usage: 1.28 s of decoding at ~20 ms per token
    assert st.learning.tokens.reported is None and 50 < st.learning.tokens.estimate < 75


def test_speeds_are_derived_on_refresh_and_models_are_not_mixed():
    st, polls, clock = setup(ep("a"), ep("b"), ep("big", model="large"))
    for c, seconds in ((ep("a"), 1.0), (ep("b"), 1.02), (ep("big", model="large"), 6.0)):
        for _ in range(6):
            st.release(Choice(c, 0.0, 0), seconds)
    assert st.stats.get("a") is None or st.stats["a"].speed is None  # not per request: on refresh
    scrape(polls, clock, "a", 0, 0, 0)
    a, b, big = (st.stats[i].speed.decode1 for i in ("a", "b", "big"))
    assert a == pytest.approx(b, rel=0.02)  # the same speed, told apart only by noise
    assert big == pytest.approx(6.0, rel=0.01)  # another model: not pulled toward a and b


def test_completion_rate_needs_every_endpoint_known():
    st, polls, clock = setup(ep("a", capacity=4), ep("b", capacity=4))
    for _ in range(3):
        st.release(Choice(ep("a", capacity=4), 0.0, 0), 1.0)
    scrape(polls, clock, "a", 0, 0, 0)
    assert st.completion_rate("m") is None  # b's speed is unknown: the drain time cannot be bounded
    for _ in range(3):
        st.release(Choice(ep("b", capacity=4), 0.0, 0), 1.0)
    scrape(polls, clock, "a", 0, 0, 0)
    rate = st.completion_rate("m")
    assert 4 < rate < 8  # two endpoints of 4 slots, about 1 s each (a little slower when full)


def st_req():
    from gateway.routing.choice import RouteRequest

    return RouteRequest("m", affinity="one-session")  # always the same endpoint


def test_a_scrape_is_compared_with_what_we_held_when_it_was_taken():
    """The engine was scraped while it ran our 3 requests; 2 ended before the gateway read the record.
    Counting what we hold at read time (1) would leave 2 phantom requests "from others" on the
    endpoint for a whole scrape interval, enough to fill it and hold requests in the queue."""
    from gateway.routing.choice import RouteRequest
    from gateway.routing.load import ahead_of, fresh_load

    st, polls, clock = setup(ep("a"))
    held = [st.route(RouteRequest("m")) for _ in range(3)]
    clock.advance(0.3)
    polls.store.records["a"] = LoadRecord("a", clock.t, True, running=3, waiting=0)  # the agent's scrape
    clock.advance(0.2)
    st.release(held[0], 1.0)
    st.release(held[1], 1.0)
    polls.refresh_loads()  # read a little later
    s = st.stats["a"]
    assert s.scrape_inflight == 3 and s.others_ratio == 0

    def ahead(n):
        s = st.stats["a"]
        return ahead_of(ep("a"), fresh_load(st.loads["a"], clock.t, st.routing, s.load_seen), n, s)

    assert ahead(1) == 1
    # another gateway's requests count: the next scrape shows 5 running while we hold 1
    clock.advance(1.0)
    polls.store.records["a"] = LoadRecord("a", clock.t, True, running=5, waiting=0)
    polls.refresh_loads()
    assert ahead(1) == 5 and st.stats["a"].others_ratio == 4
    # if we send it two more before the next scrape, the others (4 per one of ours) likely did too
    assert ahead(3) == 3 + 4 + 4 * 2


def test_an_agent_clock_that_disagrees_falls_back_to_the_most_we_held():
    from gateway.routing.choice import RouteRequest

    st, polls, clock = setup(ep("a"))
    held = [st.route(RouteRequest("m")) for _ in range(3)]
    st.release(held[0], 1.0)
    polls.store.records["a"] = LoadRecord("a", clock.t - 3600, True, running=3, waiting=0)  # an hour behind
    polls.refresh_loads()
    assert st.stats["a"].scrape_inflight == 3  # not 2: our own ended request is no other gateway's


def test_the_learner_returns_new_values_and_leaves_its_inputs_alone():
    """`fit = update(fit, sample)`: a load refresh builds the next learner and stats from the last
    ones, which readers may still hold, unchanged."""
    from gateway.routing.inflight import Answer
    from gateway.routing.learn import Learning, Tokens, learn_answer, observe_loads
    from gateway.routing.load import EndpointStats

    a = ep("a")
    before = Learning()
    answer = Answer("a", 10.0, 2.0, 1.0, 51, 0.1)
    lr, tokens = learn_answer(None, Tokens(), answer, 10.0)
    assert lr.per_request.w == 1 and lr.ttfb == pytest.approx(0.1) and tokens.reported == 51
    old = LoadRecord("a", 1.0, True, running=4, waiting=0, generation_tokens_total=0)
    new = LoadRecord("a", 2.0, True, running=4, waiting=0, generation_tokens_total=200)
    loads, prev, stats = {"a": new}, {"a": old}, {"a": EndpointStats(scrape_inflight=1)}
    state, out = observe_loads(before, loads, prev, stats, {"a": 2}, [answer], {"a": a}, 20.0,
                               GatewaySettings().routing)
    assert before == Learning() and stats == {"a": EndpointStats(scrape_inflight=1)} and prev == {"a": old}
    assert out["a"].scrape_inflight == 2 and out["a"].speed is not None and out is not stats
    # the answer's sample, halved by the 10 s since (the half-life), then the one from the two scrapes
    assert state.learned["a"].per_token.w == pytest.approx(1.5)


def test_readers_keep_the_snapshot_they_took():
    st, polls, clock = setup(ep("a"))
    taken = st.snapshot
    scrape(polls, clock, "a", 4, 0, 1000)
    assert st.snapshot is not taken and taken.loads == {} and taken.stats == {}
    assert st.snapshot.tables is taken.tables  # the list did not change: the same tables


def test_an_answer_whose_prompt_was_priced_at_the_default_rate_teaches_neither_its_decode_nor_its_first_byte():
    """A vLLM replica that has answered only short prompts has shown no prefill rate, so a 1,337-token
    prompt is priced at the default 0.1 ms a token (0.13 s), well under PROMPT_WORK_MAX, and took ten
    seconds on one core. Learned as a whole answer's decode, that priced the replica holding the
    conversation's history above prefilling all of it again elsewhere (the suite's vLLM test, on a
    clean clone). Until the engine's counters showed a rate, such an answer teaches nothing; once
    they did, it teaches as ever; an engine that counts no prefill at all is priced at the default
    for good, and teaches as ever too."""
    from gateway.config import RoutingConfig
    from gateway.routing.learn import answer_sample
    from gateway.routing.load import EndpointStats

    cfg, a = RoutingConfig(), ep("a")
    counts = LoadRecord("a", 0.0, True, running=0, waiting=0, prompt_tokens_total=40.0, prefill_seconds_total=0.5)
    assert answer_sample(a, 0, 1, 10.4, 6, None, counts, None, 0.0, cfg, prompt_work=0.13) is None
    stream = answer_sample(a, 0, 1, 10.4, 6, 10.2, counts, None, 0.0, cfg, prompt_work=0.13)
    assert stream.decode == pytest.approx(0.2) and stream.ttfb is None  # its decode, not its prefill as a step
    shown = EndpointStats(prefill=0.01)
    assert answer_sample(a, 0, 1, 13.6, 6, None, counts, shown, 0.0, cfg, prompt_work=0.13).decode == pytest.approx(13.47)
    blind = LoadRecord("a", 0.0, True, running=0, waiting=0)  # an external endpoint: no prefill counters
    assert answer_sample(a, 0, 1, 1.4, 6, None, blind, None, 0.0, cfg, prompt_work=0.13).decode == pytest.approx(1.27)
    assert answer_sample(a, 0, 1, 1.4, 6, None, counts, None, 0.0, cfg).decode == pytest.approx(1.4)  # no prompt work
