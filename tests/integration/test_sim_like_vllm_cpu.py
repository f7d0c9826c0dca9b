"""The simulated engine behaves as vLLM 0.32's CPU build was seen to (docs/engines.md, "The sim against
vLLM 0.32 on CPU"; the real side is tests/e2e/test_vllm_cpu.py): blocks of 128 tokens for `device: cpu`,
a non-streamed request dropped when its client leaves, an aborted request counted as no success,
and the prefix counters moved in whole blocks."""

from __future__ import annotations

import json
import re
import socket
import time

import requests

from llmgw.catalog import Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import LaunchContext
from harness.procs import ProcessSet, free_port, wait_until


def start_like_cpu_vllm(tmp_path, *args: str) -> tuple[ProcessSet, str]:
    """A sim started by its engine driver for a `device: cpu` profile, as an agent would start it."""
    profile = Profile(name="cpu", engine="sim", device="cpu", args=list(args))
    model = Model(name="m", profiles=[profile])
    port = free_port()
    spec = get_engine("sim").command(LaunchContext(replica_id="r", model=model, profile=profile,
                                                   host="127.0.0.1", port=port))
    procs = ProcessSet(tmp_path / "logs")
    procs.start("sim", list(spec.argv), env=spec.env)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15, what="the sim healthy")
    return procs, url


def metric(url: str, name: str, labels: str = "") -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    m = re.search(r"^%s\{[^}]*%s[^}]*\} (\S+)$" % (re.escape(name), re.escape(labels)), text, re.M)
    assert m, f"{name}{{{labels}}} missing"
    return float(m.group(1))


def test_device_cpu_blocks_are_128_tokens_and_hits_whole_blocks(tmp_path):
    procs, url = start_like_cpu_vllm(tmp_path, "--step-ms", "1")
    try:
        text = requests.get(url + "/metrics", timeout=5).text
        assert 'block_size="128"' in text  # vllm:cache_config_info, as vLLM's CPU build says
        body = {"model": "m", "max_tokens": 2,
                "messages": [{"role": "system", "content": "You are helpful. " * 300}, {"role": "user", "content": "hi"}]}
        for _ in range(2):
            assert requests.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        hits = metric(url, "vllm:prefix_cache_hits_total")
        assert hits > 0 and hits % 128 == 0  # vLLM on CPU: 1152 of 1219 prompt tokens, 9 blocks of 128
    finally:
        procs.stop_all()


def test_a_non_streamed_request_whose_client_left_is_aborted_and_no_success(tmp_path):
    procs, url = start_like_cpu_vllm(tmp_path, "--step-ms", "20")
    try:
        host, port = url.rsplit("//", 1)[1].split(":")
        for stream in (True, False):
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000,
                               "stream": stream}).encode()
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: metric(url, "vllm:num_requests_running") == 1, 10, what="the request running")
            s.close()
            t0 = time.monotonic()
            wait_until(lambda: metric(url, "vllm:num_requests_running") == 0, 1.0, interval=0.01,
                       what=f"the sim to drop the {'streamed' if stream else 'non-streamed'} request")
            assert time.monotonic() - t0 < 1.0  # vLLM on CPU: about 40 ms, streamed or not
        # vLLM counts neither under request_success_total (its abort label set stays 0).
        assert metric(url, "vllm:request_success_total", 'finished_reason="abort"') == 0
        assert metric(url, "vllm:request_success_total", 'finished_reason="repetition"') == 0
        assert metric(url, "vllm:generation_tokens_total") > 0  # the tokens made before the abort count
    finally:
        procs.stop_all()
