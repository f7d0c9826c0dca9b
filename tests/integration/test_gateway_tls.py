"""TLS at the gateway: with LLMGW_GATEWAY_CERTFILE / LLMGW_GATEWAY_KEYFILE the one gunicorn config
serves HTTPS (a self-signed certificate made here with the openssl CLI), proxied streams included."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import requests

from llmgw.state.records import EndpointInfo
from tests.support.fake_upstream import start_process
from harness.procs import wait_until


def self_signed(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def test_the_gateway_serves_https_with_the_configured_certificate(cluster, tmp_path):
    cert, key = self_signed(tmp_path)
    cluster.start_redis()
    engine = start_process(cluster.procs, "engine", base=0.05, tokens=5)
    cluster.store().write_endpoints([EndpointInfo(id="e1", url=engine, models=("m",), engine="sim", model="m",
                                                  served_name="m", capacity=4)], "fp", time.time())
    gw = cluster.start_gateway(LLMGW_GATEWAY_CERTFILE=cert, LLMGW_GATEWAY_KEYFILE=key,
                               LLMGW_GATEWAY_POLL_INTERVAL="0.2")
    assert gw.startswith("https://")
    wait_until(lambda: requests.get(gw + "/healthz", verify=cert, timeout=5).json()["endpoints"] == 1, 10,
               what="the endpoint list")
    r = requests.post(gw + "/v1/chat/completions", json={"model": "m"}, verify=cert, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    with requests.post(gw + "/v1/chat/completions", json={"model": "m", "stream": True}, verify=cert,
                       stream=True, timeout=10) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]" and len(lines) == 6
    # Only TLS on that port: a plain-HTTP client gets no answer, and nobody trusts the certificate unasked.
    with pytest.raises(requests.ConnectionError):
        requests.get(gw.replace("https://", "http://") + "/healthz", timeout=5)
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(gw + "/healthz", timeout=5)
