"""A client that goes away costs the engine nothing, on the real sim engine behind the gunicorn
gateway: a request waiting in the gateway's queue whose client disconnects leaves the queue at once
and is never sent; a stream whose client disconnects is closed upstream, and the engine frees it."""

from __future__ import annotations

import json
import re
import socket
import time

import requests

from llmgw.state.records import EndpointInfo
from harness.procs import free_port, python, wait_until

CHAT = "/v1/chat/completions"


def metric(gw: str, name: str, **labels) -> float:
    text = requests.get(gw + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return 0.0


def raw_request(gw: str, body: dict) -> socket.socket:
    """A client that sends its request and then only holds the connection (until the test closes it)."""
    host, port = gw.rsplit("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (CHAT.encode(), len(data), data))
    return s


def engine_requests(sim) -> int:
    return sim.log().count("POST /v1/chat/completions")


def test_a_queued_request_whose_client_leaves_is_never_sent(cluster):
    cluster.start_redis()
    port = free_port()
    # One sequence at a time, 50 ms a token: a 40-token stream holds the only slot for 2 s.
    sim = cluster.procs.start("sim", [python(), "-m", "simengine", "--port", str(port), "--max-seqs", "1",
                                      "--step-ms", "50", "--served-model-name", "m", "--log-requests"],
                              env=cluster.env())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 20, what="the sim engine")
    ep = EndpointInfo(id="sim", url=url, models=("m",), engine="sim", model="m", served_name="m", capacity=1)
    cluster.store().write_endpoints([ep], "fp", time.time())
    gw = cluster.start_gateway(LLMGW_GATEWAY_POLL_INTERVAL="0.2")
    wait_until(lambda: requests.get(gw + "/healthz", timeout=5).json()["endpoints"] == 1, 10, what="the list")

    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    holder = raw_request(gw, {**ask, "max_tokens": 40, "stream": True})
    try:
        wait_until(lambda: engine_requests(sim) == 1, 10, interval=0.02, what="the first request at the engine")
        queued = raw_request(gw, {**ask, "max_tokens": 2})
        wait_until(lambda: metric(gw, "llmgw_gateway_queue_length", model="m") == 1, 5, interval=0.02,
                   what="the second request in the queue")
        queued.close()
        t0 = time.monotonic()
        # Woken by its client's socket, not by the queue's 1 s fallback re-check.
        wait_until(lambda: metric(gw, "llmgw_gateway_queue_length", model="m") == 0, 0.5, interval=0.01,
                   what="the departed client's request to leave the queue within half a second")
        assert time.monotonic() - t0 < 0.5
        assert metric(gw, "llmgw_gateway_client_gone_total", model="m", phase="queued") == 1
        assert metric(gw, "llmgw_gateway_inflight", endpoint="sim") == 1  # the first one only
    finally:
        holder.close()
    # The first stream's client left too: its slot frees, and the next request is served at once.
    answer = requests.post(gw + CHAT, json={**ask, "max_tokens": 2}, timeout=10)
    assert answer.status_code == 200
    assert engine_requests(sim) == 2  # the one that left the queue never reached the engine
    wait_until(lambda: metric(gw, "llmgw_gateway_requests_total", model="m", endpoint="sim", status="aborted") == 1,
               5, what="the first stream counted as aborted")


def test_a_stream_whose_client_leaves_is_closed_at_the_engine(cluster):
    cluster.start_redis()
    port = free_port()
    sim = cluster.procs.start("sim", [python(), "-m", "simengine", "--port", str(port), "--max-seqs", "4",
                                      "--step-ms", "20", "--served-model-name", "m"], env=cluster.env())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 20, what="the sim engine")
    ep = EndpointInfo(id="sim", url=url, models=("m",), engine="sim", model="m", served_name="m", capacity=4)
    cluster.store().write_endpoints([ep], "fp", time.time())
    gw = cluster.start_gateway(LLMGW_GATEWAY_POLL_INTERVAL="0.2")
    wait_until(lambda: requests.get(gw + "/healthz", timeout=5).json()["endpoints"] == 1, 10, what="the list")

    def running() -> float:
        text = requests.get(url + "/metrics", timeout=5).text
        return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))

    s = raw_request(gw, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000,
                         "stream": True})
    try:
        s.settimeout(10)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        wait_until(lambda: running() == 1, 5, interval=0.02, what="the stream running at the engine")
    finally:
        s.close()
    wait_until(lambda: running() == 0, 1.0, interval=0.01, what="the engine to free the stream within a second")
    assert sim.popen.poll() is None


def test_a_whole_answer_whose_client_leaves_is_closed_at_the_engine(cluster):
    # vLLM (and the sim, as vLLM 0.32 on CPU was seen to) stops a non-streamed request whose client
    # left; the gateway is that client, and it must leave too (it waited for the whole answer).
    cluster.start_redis()
    port = free_port()
    sim = cluster.procs.start("sim", [python(), "-m", "simengine", "--port", str(port), "--max-seqs", "4",
                                      "--step-ms", "20", "--served-model-name", "m"], env=cluster.env())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 20, what="the sim engine")
    ep = EndpointInfo(id="sim", url=url, models=("m",), engine="sim", model="m", served_name="m", capacity=4)
    cluster.store().write_endpoints([ep], "fp", time.time())
    gw = cluster.start_gateway(LLMGW_GATEWAY_POLL_INTERVAL="0.2")
    wait_until(lambda: requests.get(gw + "/healthz", timeout=5).json()["endpoints"] == 1, 10, what="the list")

    def running() -> float:
        text = requests.get(url + "/metrics", timeout=5).text
        return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))

    s = raw_request(gw, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000})
    try:
        wait_until(lambda: running() == 1, 5, interval=0.02, what="the request running at the engine")
    finally:
        s.close()
    wait_until(lambda: running() == 0, 1.0, interval=0.01, what="the engine to free the request within a second")
    wait_until(lambda: metric(gw, "llmgw_gateway_client_gone_total", model="m", phase="answering") == 1, 5,
               what="the gateway to count the client gone")
    assert sim.popen.poll() is None
