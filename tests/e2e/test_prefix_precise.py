"""Precise prefix routing end to end (issue 30): a catalog profile with `kv_events: true` on sim engines
that publish vLLM's KV events. The agents choose the event ports, the endpoint list says where they
are, the gateway (under gunicorn, two workers) subscribes, and a conversation's later turns go to the
replica whose engine reports holding its history, with the match the engine reported in the answer's
header, and the engine's own prefix-cache counters show the hits."""

from __future__ import annotations

import re

import pytest
import requests

from harness.cluster import FAST_AGENT
from harness.procs import wait_until

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: m
    profiles:
      - name: sim
        engine: sim
        replicas: 2
        kv_events: true
        args: ["--step-ms", "2", "--prefill-ms-per-token", "0.5"]
"""
SYSTEM = {"role": "system", "content": "You answer for the billing desk of a shop, politely and briefly. " * 30}


def turn(gw: str, messages: list[dict]) -> tuple[str, int, str]:
    r = requests.post(gw + "/v1/chat/completions", timeout=30,
                      json={"model": "m", "messages": messages, "max_tokens": 6})
    assert r.status_code == 200, r.text
    note = r.headers.get("X-LLMGW-Prefix", "")
    m = re.match(r"matched=(\d+)/", note)
    # Only a match the engine itself reported counts here (not one predicted from what was sent).
    matched = int(m.group(1)) if m and "via=kv_events" in note else 0
    return r.headers["X-LLMGW-Endpoint"], matched, r.json()["choices"][0]["message"]["content"]


def test_later_turns_go_where_the_engine_reports_the_history(cluster):
    [gw] = cluster.start_system(CATALOG, node_env=FAST_AGENT, routed=2)
    store = cluster.store()
    eps = wait_until(lambda: (e := store.read_endpoints().endpoints) and all(x.kv_events for x in e) and len(e) == 2 and e, 30,
                     what="both endpoints published with their KV event addresses")
    ports = {x.kv_events.rsplit(":", 1)[1] for x in eps} | {x.kv_replay.rsplit(":", 1)[1] for x in eps}
    assert len(ports) == 4  # each replica its own pair, chosen by the agent
    recs = {r.id: r for r in store.all_replicas()}
    for e in eps:
        assert e.kv_events.endswith(f":{recs[e.id].kv_events_port}")

    def hits(url: str) -> float:
        text = requests.get(url + "/metrics", timeout=5).text
        m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    messages = [SYSTEM, {"role": "user", "content": "where is my invoice for order 1234?"}]
    first, _, answer = turn(gw, messages)
    before = hits(recs[first].url)

    def indexed(name: str, endpoint: str) -> float:
        m = re.search(r'^%s\{endpoint="%s"\} (\S+)$' % (name, re.escape(endpoint)),
                      requests.get(gw + "/metrics", timeout=5).text, re.M)
        return float(m.group(1)) if m else -1.0

    # Every worker's index has the conversation's blocks, as /metrics shows it (the least of the workers).
    wait_until(lambda: indexed("llmgw_gateway_kv_index_blocks", first) > 0, 10,
               what="the gateway's KV index to hold the first turn's blocks")
    assert indexed("llmgw_gateway_kv_index_batch", first) >= 0
    for i in range(4):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and question {i}?"}]
        # The gateway hears the engine's events within milliseconds; the next turn waits for nothing else.
        endpoint, matched, answer = wait_until(lambda: (t := turn(gw, messages)) and t[1] > 0 and t, 10,
                                               what="a turn matched by the engine's own report")
        assert endpoint == first, f"turn {i + 2} went to {endpoint}, its history is on {first}"
        assert matched > 500  # the system prompt and the turns before, in tokens
    assert hits(recs[first].url) > before + 2000
