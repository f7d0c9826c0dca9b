"""Fair queueing between API keys, end to end: real redis-server, a real gateway under gunicorn (gevent), a
fake engine process, keys made with the CLI. A light key's request overtakes a heavy key's backlog in
a saturated model's queue (and, with LLMGW_GATEWAY_FAIRNESS=fcfs, waits behind it), and the service
each key received lands in Redis for `llmgw usage`."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from llmgw.state.records import EndpointInfo
from tests.support.fake_upstream import start_process
from tests.support.gateway_app import metric
from harness.procs import wait_until

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
BACKLOG = 5


def make_key(cluster, name: str, *flags: str) -> str:
    return cluster.llmgw("keys", "create", name, *flags).stdout.strip()


@pytest.mark.parametrize("fairness, light_place", [("tokens", 1), ("fcfs", BACKLOG + 1)])
def test_a_light_key_overtakes_a_heavy_key_s_backlog(cluster, fairness, light_place):
    cluster.start_redis()
    heavy, light = make_key(cluster, "heavy"), make_key(cluster, "light")
    # Every request is held in the engine until the test opens its gate; the model takes one at a time.
    engine = start_process(cluster.procs, "engine", base=0.05, max_seqs=8, gate=True)
    cluster.store().write_endpoints([EndpointInfo(id="e1", url=engine, models=("m",), engine="sim", model="m",
                                                  served_name="m", capacity=1)], "fp", time.time())
    gw = cluster.start_gateway(LLMGW_GATEWAY_FAIRNESS=fairness, LLMGW_GATEWAY_QUEUE_TIMEOUT="120")
    order: list[str] = []
    lock = threading.Lock()

    def send(name: str, key: str) -> int:
        r = requests.post(gw + CHAT, json={"model": "m", "max_tokens": 8},
                          headers={"Authorization": f"Bearer {key}"}, timeout=120)
        with lock:
            order.append(name)
        return r.status_code

    def queued() -> float:
        return metric(requests.get(gw + "/metrics", timeout=5).text, 'llmgw_gateway_queue_length{model="m"}')

    with ThreadPoolExecutor(BACKLOG + 2) as pool:
        futures = [pool.submit(send, "h0", heavy)]  # takes the model's one slot, held at the engine
        wait_until(lambda: requests.get(engine + "/stats", timeout=5).json()["open"] == 1, 20,
                   what="the heavy key's first request to hold the engine")
        for i in range(1, BACKLOG + 1):
            futures.append(pool.submit(send, f"h{i}", heavy))
            wait_until(lambda n=i: queued() == n, 20, what=f"{i} heavy requests to wait in the gateway")
        futures.append(pool.submit(send, "light", light))
        wait_until(lambda: queued() == BACKLOG + 1, 20, what="the light request to wait behind them")
        requests.post(engine + "/gate", timeout=5)
        assert [f.result(timeout=120) for f in futures] == [200] * (BACKLOG + 2)
    assert order[0] == "h0"
    assert order.index("light") == light_place  # tokens: right after the request that held the slot
    assert [n for n in order if n != "light"] == [f"h{i}" for i in range(BACKLOG + 1)]  # FIFO within a key

    # The gateway's exchange put what each key received in Redis: `llmgw usage` shows it.
    def service() -> dict:
        rows = json.loads(cluster.llmgw("usage", "--json").stdout)["service"]
        return {r["key"]: r for r in rows}
    wait_until(lambda: {k: r["requests"] for k, r in service().items()} == {"heavy": BACKLOG + 1, "light": 1}, 20,
               what="the keys' service in Redis")
    rows = service()
    assert rows["heavy"]["service_tokens"] > rows["light"]["service_tokens"] > 0
    assert rows["heavy"]["share"] > 0.8 and rows["heavy"]["mean_wait"] > 0
