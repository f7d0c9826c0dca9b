"""`llmgw up` is the main job: started here as a user would, it serves the default catalog's llama.cpp
model, says which catalog file it applied and where the console is, answers a chat completion (and an
engine's error in the gateway's shape), and leaves nothing behind after Ctrl-C (SIGINT)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess

import openai
import pytest
import requests

from llmgw.cli.up import default_catalog_path

from harness.procs import ProcessSet, free_port, processes_with_token, python, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]


def test_llmgw_up_serves_and_stops_clean(tmp_path, no_leaked_processes):
    port = free_port()
    procs = ProcessSet(tmp_path / "logs")
    up = procs.start("up", [python(), "-m", "llmgw", "up", "--port", str(port),
                            "--state-dir", str(tmp_path / "state"), "--node", "solo"])
    try:
        wait_until(lambda: "ready: the gateway answers" in up.log() or not up.alive(), 240,
                   what="llmgw up to report ready")
        assert up.alive(), up.log()
        log = up.log()
        assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in log
        # Which catalog it applied (the file), how to copy it, and where the console is.
        default = default_catalog_path()
        assert f"llmgw up: catalog version 1: the default catalog {default} (smollm2)" in log
        assert f"  cp {default} my-catalog.yaml" in log.splitlines()
        assert f"llmgw up: the console (fleet, models, events, catalog): http://127.0.0.1:{port}/ui" in log
        page = requests.get(f"http://127.0.0.1:{port}/", headers={"Accept": "text/html"}, timeout=5)
        assert page.status_code == 200 and "console.js" in page.text and page.url.endswith("/ui")
        # Before the node's first heartbeat a replica waits for it; nothing says the pool has no node.
        events = subprocess.run([python(), "-m", "llmgw", "events", "-n", "100"], capture_output=True, text=True,
                                timeout=30, env={**os.environ, "LLMGW_STATE_DIR": str(tmp_path / "state")})
        assert events.returncode == 0 and "replica_placed" in events.stdout, events.stdout + events.stderr
        assert "no live node" not in events.stdout and "no schedulable node" not in events.stdout
        # An engine's error has the gateway's shape (llama-server's own has a number for `code`).
        bad = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "smollm2"}, timeout=30)
        assert bad.status_code == 400 and bad.json() == {"error": {"message": "'messages' is required",
                                                                   "type": "invalid_request_error",
                                                                   "code": "invalid_request"}}
        assert "Access-Control-Allow-Origin" not in bad.headers
        # A common field of the wrong type is the gateway's own 400, naming it (docs/gateway.md#bad-fields).
        field = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "smollm2", "messages": "hi"},
                              timeout=30)
        assert field.status_code == 400 and field.json()["error"]["param"] == "messages"

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        resp = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8)
        assert resp.choices[0].message.content is not None
        assert resp.usage.completion_tokens > 0

        # Its batch worker sends a batch's lines to its gateway (docs/batch.md).
        lines = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "smollm2", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "Say hello"}]}}) + "\n"
                        for i in range(2))
        f = client.files.create(file=("b.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_until(lambda: (got := client.batches.retrieve(b.id)).status == "completed" and got, 120,
                          what="the batch to complete")
        assert done.request_counts.completed == 2

        # Processes it started: redis, control, beat, node agent, batch worker, gateway, the engine (+ shim).
        assert len(processes_with_token(no_leaked_processes)) >= 7

        up.signal_group(signal.SIGINT)
        try:
            code = up.popen.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("llmgw up did not exit within 60 s of SIGINT:\n" + up.log())
        assert code == 0, up.log()
        assert "stopped" in up.log()
        # llmgw up kills whatever still carries its token before it exits; engines under their shims
        # may still be finishing that exit: allow them a bounded moment.
        wait_until(lambda: not processes_with_token(no_leaked_processes), 15,
                   what="every process llmgw up started to be gone")
    finally:
        procs.stop_all()
