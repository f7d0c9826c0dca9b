"""Eviction across gateways, end to end (gateway.routing.remote_eviction, gateway.server.remote_evictions):
real redis-server, two gateways under gunicorn, a simulated engine of 2 slots. Both slots hold a heavy
key's streams sent through the first gateway; a light key's request reaches the second. That gateway
has nothing of its own to evict, so it asks the first through Redis; the first pauses one heavy answer
and the light request takes its slot long before either heavy answer would end, though a third heavy
request waits in the first gateway for that slot. The heavy answers arrive whole, word for word the
engine's undisturbed answers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from harness.procs import free_port, python, wait_until
from llmgw import surface
from llmgw.state.records import EndpointInfo
from tests.integration.test_gateway_resume import check_stream
from tests.support.gateway_app import metric

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
STEP_MS = 20
HEAVY_TOKENS = 200  # 4 s undisturbed: the light request must not wait for one to end


def body(i: int, tokens: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": f"question number {i}, please"}],
            "max_tokens": tokens, "stream": True}


def page(url: str) -> str:
    return requests.get(url + "/metrics", timeout=5).text


def test_a_request_on_one_gateway_evicts_an_answer_held_by_another(cluster):
    cluster.start_redis()
    port = free_port()
    cluster.procs.start("engine", [python(), "-m", "simengine", "--port", str(port), "--served-model-name", "m",
                                   "--max-seqs", "2", "--step-ms", str(STEP_MS)])
    engine = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(engine + "/health", timeout=1).ok, 20, what="the engine")
    store = cluster.store()
    store.write_endpoints([EndpointInfo(id="e1", url=engine, models=("m",), engine="sim", model="m", served_name="m",
                                        capacity=2, resume=True,
                                        paths=surface.same_paths(surface.CHAT, surface.COMPLETIONS))],
                          "fp", time.time())
    heavy_key, light_key = store.create_key("heavy")[1], store.create_key("light")[1]
    heavy_bodies = [body(i, HEAVY_TOKENS) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:  # the undisturbed answers, while the gateways start
        refs = [pool.submit(lambda b=b: requests.post(engine + CHAT, json={**b, "stream": False}, timeout=60).json())
                for b in heavy_bodies]
        gw1 = cluster.start_gateway(name="gw1")
        gw2 = cluster.start_gateway(name="gw2")
        want = [f.result()["choices"][0]["message"]["content"] for f in refs]
    for u in (gw1, gw2):
        wait_until(lambda u=u: requests.get(u + "/readyz", timeout=2).status_code == 200, 30, what=f"{u} ready")

    out: dict = {}

    def send(name, url, key, b):
        t0 = time.monotonic()
        r = requests.post(url + CHAT, json=b, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        out[name] = (r.status_code, r.text, time.monotonic() - t0)

    # A third heavy request (the first one's prompt again: the same answer) waits in the first gateway's
    # queue beside the answer it pauses: the first gateway lends the slot it frees to the other
    # gateway's request (remote_evictions.LEND) until that gateway's report counts it.
    threads = [threading.Thread(target=send, args=(i, gw1, heavy_key, b))
               for i, b in enumerate([*heavy_bodies, heavy_bodies[0]])]
    want.append(want[0])
    for t in threads:
        t.start()
    # The second gateway counts the first's two answers on e1 (their exchange): it sees the model full.
    wait_until(lambda: metric(page(gw2), 'llmgw_gateway_other_gateways_inflight{endpoint="e1"}') == 2
               and metric(page(gw1), 'llmgw_gateway_queue_length{model="m"}') == 1, 20,
               what="the second gateway to see the first's two answers on e1, and one waiting in the first")
    sent_at = time.monotonic()
    light = threading.Thread(target=send, args=("light", gw2, light_key, body(99, 4)))
    light.start()
    light.join(60)
    for t in threads:
        t.join(60)
    status, text, seconds = out["light"]
    assert status == 200, text
    undisturbed = HEAVY_TOKENS * STEP_MS / 1000.0
    # It took a heavy answer's slot: well before the first heavy answer could end on its own.
    assert seconds < undisturbed / 2, (seconds, time.monotonic() - sent_at)
    for i, w in enumerate(want):
        status, text, _ = out[i]
        assert status == 200
        check_stream(text, w)  # whole, one id, one role chunk, no token lost or repeated at the seam
    first = page(gw1)
    assert metric(first, 'llmgw_gateway_evictions_total{model="m"}') == 1
    assert metric(first, 'llmgw_gateway_stream_resumes_total{model="m",outcome="resumed",reason="evicted"}') == 1
    assert metric(page(gw2), 'llmgw_gateway_evictions_total{model="m"}') == 0
