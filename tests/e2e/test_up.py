"""`llmgw up` is the main job: started here as a user would, it serves the built-in llama.cpp model,
answers a chat completion, and leaves nothing behind after Ctrl-C (SIGINT)."""

from __future__ import annotations

import io
import json
import signal
import subprocess

import openai
import pytest

from tests.support.procs import ProcessSet, free_port, processes_with_token, python, wait_until

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
        assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in up.log()

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
