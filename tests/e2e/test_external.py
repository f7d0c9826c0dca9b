"""Servers llmgw does not run, on the whole system: a sim engine started by the test and declared
`engine: external` serves chat beside a managed replica, leaves routing when it stops and returns
when it starts again; a hosted API's key (api_key_env, from the gateway's environment) reaches that
server only."""

from __future__ import annotations

import requests
import pytest

from tests.support.fake_upstream import start_process
from harness.procs import free_port, python, wait_until

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
FAST = {"LLMGW_EXTERNAL_INTERVAL": "0.3", "LLMGW_EXTERNAL_CHECK_INTERVAL": "0.3", "LLMGW_EXTERNAL_FAILURES": "2",
        "LLMGW_EXTERNAL_TIMEOUT": "1"}


def start_outside_sim(cluster, port: int) -> None:
    cluster.procs.start("outside-sim", [python(), "-m", "simengine", "--port", str(port), "--served-model-name",
                                        "upstream-tiny", "--speed", "4"], env=cluster.env())


def cards(gw: str) -> dict:
    return {c["id"]: c for c in requests.get(gw + "/v1/models", timeout=5).json()["data"]}


def chat(gw: str, model: str = "tiny") -> requests.Response:
    return requests.post(gw + CHAT, json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2}, timeout=20)


def ready(gw: str, model: str) -> int:
    return cards(gw).get(model, {}).get("ready_replicas", 0)


def test_an_external_sim_serves_beside_a_managed_replica_and_a_key_reaches_only_its_server(cluster):
    cluster.start_system(control_env=FAST, gateways=0)
    keyed = start_process(cluster.procs, "hosted-keyed", require_key="sk-test-hosted")
    plain = start_process(cluster.procs, "hosted-plain")
    port = free_port()
    start_outside_sim(cluster, port)
    gw = cluster.start_gateway(LLMGW_GATEWAY_POLICY="round_robin", HOSTED_KEY="sk-test-hosted")
    cluster.apply_catalog(f"""
models:
  - name: tiny
    profiles:
      - {{name: sim, engine: sim, replicas: 1}}
      - name: outside
        engine: external
        url: http://127.0.0.1:{port}
        server: sim
        served_name: upstream-tiny
        metrics: {{}}
        capacity: 8
  - name: hosted
    profiles:
      - name: keyed
        engine: external
        url: {keyed}
        api_key_env: HOSTED_KEY
        served_name: keyed-model
      - name: plain
        engine: external
        url: {plain}
""")
    wait_until(lambda: ready(gw, "tiny") == 2 and ready(gw, "hosted") == 2, 60,
               what="the managed replica and three external urls routable")
    # Both sims report their context length; it reaches the gateway with the next scrapes (the agent's
    # and the external pass's), which may come a little after the endpoints are routable.
    wait_until(lambda: cards(gw)["tiny"]["context_length"] == 65536, 30, what="the context length in /v1/models")
    assert cards(gw)["tiny"]["engines"] == ["external", "sim"]

    served = set()
    for _ in range(6):
        r = chat(gw)
        assert r.status_code == 200, r.text
        served.add(r.headers["X-LLMGW-Endpoint"])
    outside = next(e for e in served if e.startswith("ext-tiny-outside-"))
    assert len(served) == 2

    for _ in range(6):
        assert requests.post(gw + CHAT, json={"model": "hosted"}, timeout=20).status_code == 200
    got = {name: requests.get(url + "/stats", timeout=5).json() for name, url in (("keyed", keyed), ("plain", plain))}
    assert set(got["keyed"]["authorization"]) == {"Bearer sk-test-hosted"} and set(got["keyed"]["models_seen"]) == {
        "keyed-model"}
    assert set(got["plain"]["authorization"]) == {None} and len(got["plain"]["authorization"]) == 3
    status = cluster.llmgw("status").stdout
    assert "EXTERNAL SERVERS (3)" in status and "sk-test-hosted" not in status
    assert "sk-test-hosted" not in str(cluster.redis().keys("*")) + cluster.llmgw("catalog", "show", "--json").stdout

    # Stopped: it leaves routing, and no request fails meanwhile (one sent there is retried elsewhere).
    cluster.procs.get("outside-sim").stop()
    statuses = []

    def gone_while_serving() -> bool:
        statuses.append(chat(gw).status_code)
        return ready(gw, "tiny") == 1

    wait_until(gone_while_serving, 30, what="the stopped sim out of routing")
    assert set(statuses) == {200}
    assert "Unreachable" in cluster.llmgw("status").stdout
    for _ in range(3):
        r = chat(gw)
        assert r.status_code == 200 and r.headers["X-LLMGW-Endpoint"] != outside

    # Started again: it returns under the same endpoint id.
    start_outside_sim(cluster, port)
    wait_until(lambda: ready(gw, "tiny") == 2, 30, what="the outside sim back in routing")
    back = {chat(gw).headers["X-LLMGW-Endpoint"] for _ in range(4)}
    assert outside in back
