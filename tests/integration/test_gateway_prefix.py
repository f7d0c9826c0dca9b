"""Prefix-cache-aware routing through the real gateway (gunicorn's gevent worker, redis-server) on two
simulated engines with vLLM's prefix cache: a conversation's turns go to one replica, the answer says
what the gateway expected it to hold, and the engine's own hit counter rises."""

from __future__ import annotations

import re
import time

import requests

from llmgw.state.records import EndpointInfo
from tests.support.gateway_app import metric
from harness.procs import free_port, python, wait_until

CHAT = "/v1/chat/completions"
SYSTEM = "You are the billing assistant. " + " ".join(f"rule {i}: refunds need an order number." for i in range(120))


def start_sim(cluster, name: str) -> str:
    port = free_port()
    cluster.procs.start(name, [python(), "-m", "simengine", "--host", "127.0.0.1", "--port", str(port),
                               "--served-model-name", "m", "--step-ms", "2", "--max-seqs", "4",
                               "--max-tokens-default", "8"])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15, what=f"{name} /health")
    return url


def hits(url: str) -> tuple[float, float]:
    text = requests.get(url + "/metrics", timeout=5).text
    got = {m.group(1): float(m.group(2)) for m in
           re.finditer(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} (\S+)$", text, re.M)}
    return got.get("hits", 0.0), got.get("queries", 0.0)


def test_a_conversations_turns_go_to_one_replica_whose_prefix_cache_hits(cluster):
    cluster.start_redis()
    urls = {n: start_sim(cluster, f"engine-{n}") for n in ("a", "b")}
    eps = [EndpointInfo(id=i, url=u, models=("m",), engine="sim", model="m", served_name="m", capacity=4)
           for i, u in urls.items()]
    cluster.store().write_endpoints(eps, "fp-prefix", time.time())
    gw = cluster.start_gateway(port=free_port(), LLMGW_GATEWAY_SEED="1")
    wait_until(lambda: requests.get(gw + "/healthz", timeout=5).json()["endpoints"] == 2, 10, what="endpoints")
    before = {n: hits(u) for n, u in urls.items()}
    s = requests.Session()
    msgs = [{"role": "system", "content": SYSTEM}]
    served, notes = [], []
    for turn in range(4):
        msgs.append({"role": "user", "content": f"question {turn} about my refund"})
        stream = turn % 2 == 1  # both kinds of answer carry the header
        r = s.post(gw + CHAT, json={"model": "m", "messages": msgs, "stream": stream}, timeout=30)
        assert r.status_code == 200, r.text
        served.append(r.headers["X-LLMGW-Endpoint"])
        notes.append(r.headers["X-LLMGW-Prefix"])
        if stream:
            text = "".join(re.findall(r'"content": ?"([^"]*)"', r.text))
        else:
            text = r.json()["choices"][0]["message"]["content"]
        msgs.append({"role": "assistant", "content": text})
    assert len(set(served)) == 1, served
    first = re.match(r"matched=(\d+)/(\d+) tokens; endpoint_hit=([\d.]+); saved_ms=([\d.]+)", notes[0])
    assert first and first.group(1) == "0", notes[0]
    # and why it went there: its expected cost, what the endpoint held, the rule that picked it, and
    # the endpoint that came next (what it was expected to cost and to hold)
    nxt = r'; runner_up=\S+; runner_up_ms=\d+; runner_up_matched=\d+'
    assert re.search(r'; expected_ms=\d+; ahead=0; backlog_ms=\d+; held_ms=0; rule="tier 0, prefix placed"' + nxt + '$',
                     notes[0]), notes[0]
    assert all(re.search(r'; expected_ms=\d+; ahead=\d+; backlog_ms=\d+; held_ms=0; rule="tier 0[^"]*"' + nxt + '$', n)
               for n in notes[1:]), notes
    for note in notes[1:]:
        m = re.match(r"matched=(\d+)/(\d+) tokens; endpoint_hit=([\d.]+); saved_ms=([\d.]+)", note)
        assert m and int(m.group(1)) > 0.8 * len(SYSTEM) / 4 and float(m.group(3)) > 0.5, note
    one = served[0]
    h0, q0 = before[one]
    h1, q1 = hits(urls[one])
    assert h1 - h0 > 0.5 * (q1 - q0) > 0  # the engine reused most of the prompts of turns 2-4
    other = "b" if one == "a" else "a"
    assert hits(urls[other]) == before[other]  # the other replica saw nothing of it
    page = requests.get(gw + "/metrics", timeout=5).text
    assert metric(page, f'llmgw_gateway_prefix_predicted_hit_tokens_total{{endpoint="{one}"}}') > len(SYSTEM) / 4
    assert metric(page, f'llmgw_gateway_prefix_saved_seconds_total{{endpoint="{one}"}}') > 0


def test_a_turn_through_another_gateway_finds_the_history_the_first_gateway_sent(cluster):
    """Two gateways (each its own gunicorn) on one Redis, as behind an L4 load balancer: the second
    turn reaches the other gateway, which learned from Redis what the first sent where, so it expects
    the history on the same replica, sends it there, and the engine reuses it."""
    cluster.start_redis()
    urls = {n: start_sim(cluster, f"engine-{n}") for n in ("a", "b", "c")}
    eps = [EndpointInfo(id=i, url=u, models=("m",), engine="sim", model="m", served_name="m", capacity=4)
           for i, u in urls.items()]
    cluster.store().write_endpoints(eps, "fp-prefix", time.time())
    gateways = [cluster.start_gateway(port=free_port(), name=f"gateway-{i}", LLMGW_GATEWAY_SEED=str(i))
                for i in (1, 2)]
    for gw in gateways:
        wait_until(lambda: requests.get(gw + "/healthz", timeout=5).json()["endpoints"] == 3, 10, what="endpoints")
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "question 0 about my refund " + "with details " * 200}]
    first = requests.post(gateways[0] + CHAT, json={"model": "m", "messages": msgs}, timeout=30)
    assert first.status_code == 200, first.text
    one = first.headers["X-LLMGW-Endpoint"]

    def learned() -> float:
        page = requests.get(gateways[1] + "/metrics", timeout=5).text
        return metric(page, 'llmgw_gateway_sends_shared_total{direction="learned"}')

    wait_until(lambda: learned() >= 1, 10, what="the second gateway to learn the first one's send")
    msgs += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "and how long will it take?"}]
    before = hits(urls[one])
    second = requests.post(gateways[1] + CHAT, json={"model": "m", "messages": msgs}, timeout=30)
    assert second.status_code == 200, second.text
    assert second.headers["X-LLMGW-Endpoint"] == one
    m = re.match(r"matched=(\d+)/(\d+) tokens", second.headers["X-LLMGW-Prefix"])
    assert m and int(m.group(1)) > 0.8 * int(m.group(2)), second.headers["X-LLMGW-Prefix"]
    h1, q1 = hits(urls[one])
    assert h1 - before[0] > 0.8 * (q1 - before[1]) > 0  # the engine reused the history


def test_a_gateway_counts_what_another_gateway_holds_before_any_scrape_shows_it(cluster):
    """Two gateways (each its own gunicorn) on one Redis, and no agent scraping the engines: the
    first gateway (two workers: it says what they hold together) fills one endpoint to its capacity
    with long streams of one session; the second, told through Redis what the first holds, sends
    every request elsewhere (knowing nothing, it would place each by its prompt's hash, either
    endpoint), and once the streams end it counts nothing there any more. (The second has one worker:
    each worker hears the others on its own, and the metric waited on is one worker's view.)"""
    cluster.start_redis()
    urls = {n: start_sim(cluster, f"engine-{n}") for n in ("a", "b")}
    eps = [EndpointInfo(id=i, url=u, models=("m",), engine="sim", model="m", served_name="m", capacity=3)
           for i, u in urls.items()]
    cluster.store().write_endpoints(eps, "fp-holds", time.time())
    first, second = (cluster.start_gateway(port=free_port(), name=f"gateway-{i}", LLMGW_GATEWAY_WORKERS=workers,
                                           LLMGW_GATEWAY_SEED=str(i)) for i, workers in ((1, "2"), (2, "1")))
    for gw in (first, second):
        wait_until(lambda: requests.get(gw + "/healthz", timeout=5).json()["endpoints"] == 2, 10, what="endpoints")
    streams = []
    try:
        for i in range(3):  # one session: affinity keeps them on one endpoint
            r = requests.post(first + CHAT, json={"model": "m", "stream": True, "max_tokens": 5000,
                                                  "messages": [{"role": "user", "content": f"a long story {i}"}]},
                              headers={"X-Session-ID": "reader"}, stream=True, timeout=30)
            assert r.status_code == 200, r.text
            streams.append(r)
        (full,) = {r.headers["X-LLMGW-Endpoint"] for r in streams}
        other = "b" if full == "a" else "a"

        def others_hold(ep: str) -> float:
            page = requests.get(second + "/metrics", timeout=5).text
            return metric(page, f'llmgw_gateway_other_gateways_inflight{{endpoint="{ep}"}}')

        wait_until(lambda: others_hold(full) == 3, 10, what="the second gateway to learn what the first holds")
        served = []
        for i in range(6):
            r = requests.post(second + CHAT, json={"model": "m", "max_tokens": 1, "messages": [
                {"role": "user", "content": f"question number {i} " + f"about topic {i} " * 20}]}, timeout=30)
            assert r.status_code == 200, r.text
            served.append((r.headers["X-LLMGW-Endpoint"], r.headers.get("X-LLMGW-Prefix")))
        assert [e for e, _ in served] == [other] * 6, served
    finally:
        for r in streams:
            r.close()
    wait_until(lambda: others_hold(full) == 0, 10, what="the first gateway's streams to end in the second's count")
