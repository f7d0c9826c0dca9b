"""Engines only llmgw can call (issue 19), on two nodes: each replica's engine refuses a request
without its secret, answers the gateway, never sees a client's key; `llmgw engines
rotate-credentials` replaces the replicas by a rolling update with fresh secrets while a client keeps
being served."""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from llmgw.state.replica_state import State, derive
from tests.e2e.test_fleet import ClientLoop
from harness.cluster import FAST_AGENT, sim_catalog
from harness.procs import wait_until

pytestmark = pytest.mark.slow

CATALOG = sim_catalog(replicas=2, aliases=["chat-latest"], drain_timeout=10, args=["--log-headers", "--step-ms", "1"])

AGENT = {**FAST_AGENT, "LLMGW_AGENT_STOP_GRACE": "3"}
GATEWAY = {"LLMGW_GATEWAY_KEYS_INTERVAL": "0.2", "LLMGW_GATEWAY_POLL_INTERVAL": "0.2"}
BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def digest(token: str) -> str:
    """How the sim's --log-headers shows a bearer token."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def ready(cluster):
    store = cluster.store()
    live = store.live_nodes()
    return sorted((r for r in store.all_replicas()
                   if derive(r, r.node in live, time.time()).state is State.READY and r.stop_requested_at is None),
                  key=lambda r: r.id)


def engine_log(cluster, rec) -> str:
    return (cluster.root / "nodes" / rec.node / "replicas" / rec.id / "engine.log").read_text(errors="replace")


def test_engines_answer_only_the_gateway_and_rotate_by_rolling_update(cluster):
    [gw] = cluster.start_system(nodes=("a", "b"), node_env=AGENT, gateway_env=GATEWAY)
    key = cluster.llmgw("keys", "create", "team-a").stdout.strip()
    auth = {"Authorization": f"Bearer {key}"}
    cluster.apply_catalog(CATALOG)
    recs = wait_until(lambda: (lambda r: r if len(r) == 2 else None)(ready(cluster)), 60, what="2 Ready replicas")
    assert {r.node for r in recs} == {"a", "b"}  # CPU replicas are spread: one per node
    assert all(r.engine_secret for r in recs) and recs[0].engine_secret != recs[1].engine_secret

    # Through the gateway it works, on both replicas.
    wait_until(lambda: requests.post(gw + "/v1/chat/completions", json=BODY, headers=auth,
                                     timeout=10).status_code == 200, 20, what="the gateway to serve")
    served: set[str] = set()

    def both_served():
        # Concurrent requests, so the router's in-flight counts spread them over both replicas.
        with ThreadPoolExecutor(8) as pool:
            for r in pool.map(lambda _: requests.post(gw + "/v1/chat/completions", json={**BODY, "max_tokens": 20},
                                                      headers=auth, timeout=10), range(8)):
                assert r.status_code == 200, r.text
                served.add(r.headers["X-LLMGW-Endpoint"])
        return served == {rec.id for rec in recs}

    wait_until(both_served, 30, interval=0.05, what="answers from both replicas")
    for rec in recs:
        log = engine_log(cluster, rec)
        # The gateway sent the replica's own secret; the client's key never reached the engine.
        assert f"POST /v1/chat/completions: " in log and f"Bearer {digest(rec.engine_secret)}" in log
        assert key not in log and digest(key) not in log
        assert rec.engine_secret not in log  # and the log never holds the secret itself

    for rec in recs:
        # Straight to the engine's port: refused without its secret, and with a client's key.
        for headers in ({}, auth):
            r = requests.post(rec.url + "/v1/chat/completions", json=BODY, headers=headers, timeout=10)
            assert r.status_code == 401, (rec.id, headers, r.text)
        # What the agent needs stays open.
        assert requests.get(rec.url + "/health", timeout=5).status_code == 200
        assert "vllm:num_requests_running" in requests.get(rec.url + "/metrics", timeout=5).text

    # Rotation: the normal rolling update (new Ready first, old drained), a client served throughout.
    loop = ClientLoop(gw)
    loop.client = loop.client.with_options(api_key=key)
    loop.start()
    try:
        wait_until(lambda: loop.ok >= 3, 20, what="the client loop to get answers")
        out = cluster.llmgw("engines", "rotate-credentials", "chat-latest").stdout
        assert "engine credentials of chat rotated: 2 replica(s)" in out
        old = {r.id for r in recs}
        wait_until(lambda: (lambda r: len(r) == 2 and not old & {x.id for x in r})(ready(cluster)), 90,
                   what="both replicas replaced")
        before = loop.ok
        wait_until(lambda: loop.ok >= before + 3, 20, what="answers from the new replicas")
    finally:
        loop.stop()
    assert not loop.errors, loop.errors[:5]
    new = ready(cluster)
    assert {r.credential_generation for r in new} == {1}
    assert not {r.engine_secret for r in new} & {r.engine_secret for r in recs}
    for rec in new:
        assert requests.post(rec.url + "/v1/chat/completions", json=BODY, timeout=10).status_code == 401
    bad = cluster.llmgw("engines", "rotate-credentials", "nope", check=False)
    assert bad.returncode == 1 and "no model in the applied catalog named 'nope'" in bad.stderr
