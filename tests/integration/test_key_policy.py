"""Per-key policy on real processes: keys made with the CLI, two gunicorn gateways on one Redis, the
simulated engine's real token counts. A key sees only its models, its budget stops it after the
request that crosses it (on the other gateway too), and `llmgw usage` / `GET /v1/llmgw/usage` show
what remains."""

from __future__ import annotations

import json
import time
from datetime import datetime

import openai
import pytest
import requests

from llmgw.state.records import EndpointInfo
from harness.procs import free_port, python, wait_until

CHAT = "/v1/chat/completions"
FAST = {"LLMGW_GATEWAY_KEYS_INTERVAL": "0.2", "LLMGW_GATEWAY_POLL_INTERVAL": "0.2",
        "LLMGW_GATEWAY_USAGE_FLUSH": "0.1"}
# The sim counts "hi" as 7 prompt tokens (2 + 4 per message + 1) and answers exactly max_tokens.
ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}  # 17 tokens per answer


def sim(cluster, name: str, *names: str) -> str:
    port = free_port()
    cluster.procs.start(name, [python(), "-m", "simengine", "--port", str(port), "--step-ms", "1",
                               "--served-model-name", *names])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15, what=f"{name} /health")
    return url


def test_models_budget_and_usage_across_two_gateways(cluster):
    cluster.start_redis()
    eps = [EndpointInfo(id="e-chat", url=sim(cluster, "chat", "chat", "chat-latest"), models=("chat", "chat-latest"),
                        engine="sim", model="chat", served_name="chat", capacity=8),
           EndpointInfo(id="e-code", url=sim(cluster, "code", "code"), models=("code",), engine="sim",
                        model="code", served_name="code", capacity=8)]
    cluster.store().write_endpoints(eps, "fp", time.time())
    gw1 = cluster.start_gateway(**FAST)
    gw2 = cluster.start_gateway(name="gateway2", **FAST)
    key = cluster.llmgw("keys", "create", "team", "--models", "chat-latest", "--budget", "40").stdout.strip()
    auth = {"Authorization": f"Bearer {key}"}
    for gw in (gw1, gw2):
        wait_until(lambda: requests.post(gw + CHAT, json={"model": "code", **ASK}, headers=auth,
                                         timeout=10).status_code == 404, 10, what="the key table on " + gw)

    client = openai.OpenAI(base_url=gw1 + "/v1", api_key=key, max_retries=0, timeout=10)
    assert sorted(m.id for m in client.models.list().data) == ["chat", "chat-latest"]
    with pytest.raises(openai.NotFoundError, match="model 'code' does not exist"):
        client.chat.completions.create(model="code", **ASK)

    # 17, 34, 51: the third answer crosses 40 and is served in full; then 429 until the month ends (UTC).
    served = [client.chat.completions.create(model="chat", **ASK).usage.total_tokens for _ in range(3)]
    assert served == [17, 17, 17]
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="chat", **ASK)
    assert e.value.response.json()["error"]["code"] == "budget_exceeded"
    resets = requests.get(gw1 + "/v1/llmgw/usage", headers=auth, timeout=5).json()["budget"]["resets_at"]
    next_month = datetime.fromisoformat(resets.replace("Z", "+00:00")).timestamp()
    assert resets.endswith("-01T00:00:00Z")
    assert abs(int(e.value.response.headers["Retry-After"]) - (next_month - time.time())) <= 2
    # The other gateway learns it from the flushed totals, within its flush intervals (asking it what it
    # knows spends nothing; a request sent before then would still be served: the documented bound).
    wait_until(lambda: requests.get(gw2 + "/v1/llmgw/usage", headers=auth, timeout=5).json()["budget"]["used"] == 51,
               10, what="the second gateway to learn the spent tokens")
    assert requests.post(gw2 + CHAT, json={"model": "chat", **ASK}, headers=auth, timeout=10).status_code == 429

    mine = requests.get(gw1 + "/v1/llmgw/usage", headers=auth, timeout=5).json()
    assert mine["budget"]["used"] == 51 and mine["budget"]["remaining"] == 0 and mine["models"] == ["chat-latest"]
    out = json.loads(cluster.llmgw("usage", "--json").stdout)
    [budget] = out["budgets"]
    assert (budget["key"], budget["used"], budget["tokens"], budget["remaining"]) == ("team", 51, 40, 0)
    [row] = [u for u in out["usage"] if u["key"] == "team"]
    assert (row["model"], row["requests"], row["prompt_tokens"], row["completion_tokens"]) == ("chat", 3, 21, 30)

    # Raising the budget with `keys update` lets the same key go on, on both gateways.
    cluster.llmgw("keys", "update", "team", "--budget", "1k")
    for gw in (gw1, gw2):
        wait_until(lambda: requests.post(gw + CHAT, json={"model": "chat-latest", **ASK}, headers=auth,
                                         timeout=10).status_code == 200, 10, what="the raised budget on " + gw)
