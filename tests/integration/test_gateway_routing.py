"""Through real HTTP (gunicorn gthread, real redis-server, fake engines as processes): load-aware
routing on a skewed fleet, shedding by priority, and retrying when an engine refuses connections."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from llmgw.records import EndpointInfo
from tests.support.fake_upstream import start_process
from tests.support.loadgen import paced
from tests.support.procs import free_port, wait_until

CHAT = "/v1/chat/completions"


def publish(cluster, urls: dict[str, str], capacity: int = 4, **kw) -> None:
    eps = [EndpointInfo(id=i, url=u, models=("m",), engine="sim", model="m", served_name="m", capacity=capacity, **kw)
           for i, u in urls.items()]
    cluster.store().write_endpoints(eps, "fp-" + "-".join(sorted(urls)), time.time())


def open_loop(url: str, rate: float, seconds: float) -> list[float]:
    """Poisson-free, evenly paced arrivals at `rate`/s (an open loop: slow answers do not slow the
    arrivals, as with real users); returns each request's latency."""
    lat: list[float] = []
    lock = threading.Lock()
    sess = threading.local()

    def one():
        s = getattr(sess, "s", None) or requests.Session()
        sess.s = s
        t = time.monotonic()
        r = s.post(url + CHAT, json={"model": "m", "messages": []}, timeout=60)
        assert r.status_code == 200, r.text
        with lock:
            lat.append(time.monotonic() - t)

    paced(one, rate, seconds)
    return lat


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_load_aware_routing_beats_round_robin_on_a_skewed_fleet(cluster):
    cluster.start_redis()
    speeds = {"f1": 1, "f2": 1, "half": 0.5, "quarter": 0.25}
    # base 0.2 s, 4 slots: capacities 20 + 20 + 10 + 5 = 55 req/s; we offer 80 % of it.
    urls = {n: start_process(cluster.procs, f"engine-{n}", speed=s, max_seqs=4, base=0.2) for n, s in speeds.items()}
    publish(cluster, urls)
    results = {}
    for policy in ("llmgw", "round_robin"):
        port = free_port()
        gw = cluster.start_gateway(port=port, LLMGW_GATEWAY_POLICY=policy, LLMGW_GATEWAY_SEED="1")
        wait_until(lambda: requests.get(gw + "/healthz").json()["endpoints"] == 4, 10, what="endpoints")
        open_loop(gw, rate=20, seconds=1)  # warm-up: the router learns the speeds
        results[policy] = p99(open_loop(gw, rate=44, seconds=3))
        cluster.procs.get("gateway").stop()
    print("p99 by policy:", results)
    # Round robin gives the quarter-speed engine twice what it can do; its queue grows for the whole
    # run. The load-aware router keeps it to overflow only.
    assert results["round_robin"] > 2.0 * results["llmgw"], results


def test_shedding_by_priority(cluster):
    cluster.start_redis()
    url = start_process(cluster.procs, "engine", max_seqs=1, base=1.5)
    publish(cluster, {"e1": url}, capacity=1)
    gw = cluster.start_gateway(LLMGW_GATEWAY_QUEUE_TIMEOUT="0.3")
    wait_until(lambda: requests.get(gw + "/healthz").json()["endpoints"] == 1, 10, what="endpoints")
    with ThreadPoolExecutor(4) as pool:
        busy = pool.submit(requests.post, gw + CHAT, json={"model": "m"}, timeout=30)
        wait_until(lambda: requests.get(gw + "/healthz").json()["inflight"] == 1, 5, what="the slot to fill")
        shed = requests.post(gw + CHAT, json={"model": "m"}, headers={"X-LLMGW-Priority": "sheddable"})
        assert shed.status_code == 429 and shed.json()["error"]["code"] == "overloaded"
        assert int(shed.headers["Retry-After"]) >= 1
        std = requests.post(gw + CHAT, json={"model": "m"})  # waits 0.3 s in the queue, then 429
        assert std.status_code == 429 and "Retry-After" in std.headers
        crit = pool.submit(requests.post, gw + CHAT, json={"model": "m"},
                           headers={"X-LLMGW-Priority": "critical"}, timeout=30)
        assert crit.result().status_code == 200
        assert busy.result().status_code == 200
    metrics = requests.get(gw + "/metrics").text
    assert 'llmgw_gateway_shed_total{model="m",reason="saturated"} 1.0' in metrics
    assert 'reason="queue_timeout"} 1.0' in metrics


def test_standard_request_waits_for_a_free_slot(cluster):
    cluster.start_redis()
    url = start_process(cluster.procs, "engine", max_seqs=1, base=0.5)
    publish(cluster, {"e1": url}, capacity=1)
    gw = cluster.start_gateway(LLMGW_GATEWAY_QUEUE_TIMEOUT="5")
    wait_until(lambda: requests.get(gw + "/healthz").json()["endpoints"] == 1, 10, what="endpoints")
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(requests.post, gw + CHAT, json={"model": "m"}, timeout=30) for _ in range(3)]
        assert [f.result().status_code for f in futs] == [200, 200, 200]
    # the engine never saw more than one at a time: the gateway queued the others
    assert requests.get(url + "/stats").json()["requests"] == 3


def test_retry_when_an_engine_refuses_connections(cluster):
    cluster.start_redis()
    good = start_process(cluster.procs, "engine", base=0.01)
    dead = f"http://127.0.0.1:{free_port()}"
    publish(cluster, {"dead": dead, "good": good})
    gw = cluster.start_gateway()
    wait_until(lambda: requests.get(gw + "/healthz").json()["endpoints"] == 2, 10, what="endpoints")
    s = requests.Session()
    for _ in range(20):
        r = s.post(gw + CHAT, json={"model": "m"})
        assert r.status_code == 200 and r.headers["X-LLMGW-Endpoint"] == "good"
    assert requests.get(good + "/stats").json()["requests"] == 20
    assert "llmgw_gateway_retries_total" in requests.get(gw + "/metrics").text
