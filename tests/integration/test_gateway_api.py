"""Through real HTTP: the `openai` SDK streaming through the gateway, API keys and rate limits made
with the CLI, usage shown by `llmgw usage`, and serving through a Redis outage."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from llmgw.state import keys
from llmgw.state.records import EndpointInfo
from tests.support.fake_upstream import start_process
from harness.procs import wait_until

CHAT = "/v1/chat/completions"
FAST = {"LLMGW_GATEWAY_KEYS_INTERVAL": "0.2", "LLMGW_GATEWAY_POLL_INTERVAL": "0.2", "LLMGW_GATEWAY_USAGE_FLUSH": "0.1"}


def publish(cluster, urls: dict[str, str]) -> None:
    eps = [EndpointInfo(id=i, url=u, models=("m", "m-alias"), engine="sim", model="m", served_name="served-m",
                        capacity=8) for i, u in urls.items()]
    cluster.store().write_endpoints(eps, "fp-" + "-".join(sorted(urls)), time.time())


def healthz(gw: str) -> dict:
    return requests.get(gw + "/healthz", timeout=5).json()


def wait_endpoints(gw: str, n: int) -> None:
    wait_until(lambda: healthz(gw)["endpoints"] == n, 10, what=f"{n} endpoints")


def test_openai_sdk_streaming_keys_limits_and_usage(cluster):
    cluster.start_redis()
    publish(cluster, {"e1": start_process(cluster.procs, "engine", base=0.05, tokens=6)})
    gw = cluster.start_gateway(**FAST)
    wait_endpoints(gw, 1)
    models = openai.OpenAI(base_url=gw + "/v1", api_key="none", timeout=10).models.list()
    assert sorted(m.id for m in models.data) == ["m", "m-alias"]

    key = cluster.llmgw("keys", "create", "team-a").stdout.strip()
    limited = cluster.llmgw("keys", "create", "tiny", "--rpm", "2").stdout.strip()
    assert key.startswith("sk-llmgw-") and key not in cluster.llmgw("keys", "list").stdout
    wait_until(lambda: requests.post(gw + CHAT, json={"model": "m"}, timeout=5).status_code == 401, 5,
               what="keys enforced")

    client = openai.OpenAI(base_url=gw + "/v1", api_key=key, max_retries=0, timeout=10)
    stream = client.chat.completions.create(model="m-alias", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "t0 t1 t2 t3 t4 t5 "
    assert chunks[-1].usage.completion_tokens == 6
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert plain.usage.total_tokens == 11

    bad = openai.OpenAI(base_url=gw + "/v1", api_key="sk-wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=[])
    small = openai.OpenAI(base_url=gw + "/v1", api_key=limited, max_retries=0, timeout=10)
    # rpm windows are wall-clock minutes: start the burst early in one, so all three calls share it
    wait_until(lambda: time.time() % 60 < 45, 20, interval=0.2, what="the first 45 s of a minute")
    small.chat.completions.create(model="m", messages=[])
    small.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.RateLimitError):
        small.chat.completions.create(model="m", messages=[])

    # The gateway flushes usage to Redis in the background: wait on the hashes themselves, then ask the
    # CLI once.
    r = cluster.redis()
    ids = {name: kid for kid, name in cluster.store().key_names().items()}
    wait_until(lambda: r.hget(keys.usage(ids["team-a"]), "m:requests") == "2"
               and r.hget(keys.usage(ids["tiny"]), "m:requests") == "2", 30, what="usage to be flushed")
    rows = {(u["key"], u["model"]): u for u in json.loads(cluster.llmgw("usage", "--json").stdout)["usage"]}
    assert rows[("team-a", "m")]["requests"] == 2 and rows[("team-a", "m")]["completion_tokens"] == 12
    assert rows[("tiny", "m")]["requests"] == 2  # the rate-limited call is not counted
    assert "team-a" in cluster.llmgw("usage").stdout

    cluster.llmgw("keys", "revoke", "team-a")
    wait_until(lambda: requests.post(gw + CHAT, json={"model": "m"}, headers={"Authorization": f"Bearer {key}"},
                                     timeout=5).status_code == 401, 5, what="the revoked key to be refused")
    bad_create = cluster.llmgw("keys", "create", "x", "--rpm", "0", check=False)
    assert bad_create.returncode != 0 and "--rpm" in bad_create.stderr and "Traceback" not in bad_create.stderr


def test_client_going_away_closes_the_upstream_stream(cluster):
    cluster.start_redis()
    engine = start_process(cluster.procs, "engine", base=3.0, tokens=30)
    publish(cluster, {"e1": engine})
    gw = cluster.start_gateway(**FAST)
    wait_endpoints(gw, 1)
    with requests.post(gw + CHAT, json={"model": "m", "stream": True}, stream=True, timeout=10) as r:
        it = r.iter_lines()
        assert next(l for l in it if l).startswith(b"data:")
    # the engine notices the gateway hung up long before its 3 s stream would have ended
    wait_until(lambda: requests.get(engine + "/stats", timeout=5).json()["cancelled"] == 1, 5, what="upstream closed")
    wait_until(lambda: healthz(gw)["inflight"] == 0, 5, what="in-flight released")


def test_serves_through_a_redis_outage_and_recovers(cluster):
    cluster.start_redis()
    a = start_process(cluster.procs, "engine-a", base=0.01)
    publish(cluster, {"a": a})
    gw = cluster.start_gateway(**FAST)
    wait_endpoints(gw, 1)
    s = requests.Session()
    assert s.post(gw + CHAT, json={"model": "m"}, timeout=5).status_code == 200

    cluster.stop_redis()
    # Deadlines, not speeds: generous, so a loaded 2-core CI machine does not fail them.
    wait_until(lambda: healthz(gw)["redis"] == "unavailable", 20, what="outage seen")
    for _ in range(20):
        r = s.post(gw + CHAT, json={"model": "m"}, timeout=5)
        assert r.status_code == 200 and r.headers["X-LLMGW-Endpoint"] == "a"
    assert "llmgw_gateway_redis_unavailable 1.0" in requests.get(gw + "/metrics", timeout=5).text

    cluster.restart_redis()  # comes back empty, as after a crash without persistence
    wait_until(lambda: healthz(gw)["redis"] == "ok", 30, what="recovery")
    assert s.post(gw + CHAT, json={"model": "m"}, timeout=5).status_code == 200  # still the last list
    b = start_process(cluster.procs, "engine-b", base=0.01)
    publish(cluster, {"b": b})  # the control plane republishes (version 1 again, other content)
    wait_until(lambda: s.post(gw + CHAT, json={"model": "m"}, timeout=5).headers.get("X-LLMGW-Endpoint") == "b", 30,
               what="the republished list to be used")
    log = cluster.procs.get("gateway").log(200)
    assert log.count("redis unavailable") == 1, log


def test_streams_from_the_simulated_engine(cluster):
    """The real sim engine (`python -m simengine`) behind the gateway, through the openai SDK."""
    from harness.procs import free_port, python

    cluster.start_redis()
    port = free_port()
    cluster.procs.start("sim", [python(), "-m", "simengine", "--port", str(port),
                                "--served-model-name", "served-m", "--max-seqs", "4", "--speed", "4"],
                        env=cluster.env())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 20, what="the sim engine")
    publish(cluster, {"sim": url})
    gw = cluster.start_gateway(**FAST)
    wait_endpoints(gw, 1)
    client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0, timeout=30)
    chunks = list(client.chat.completions.create(
        model="m-alias", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    plain = client.completions.create(model="m", prompt="hello", max_tokens=3)
    assert plain.usage.completion_tokens == 3
