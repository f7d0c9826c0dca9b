"""The Procfile is runnable: `honcho start` brings up every role (Flower included), the gateway
answers a chat completion for a catalog applied with the CLI, and stopping honcho stops everything,
engines included."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests

from harness.cluster import FAST_ENV
from harness.procs import ProcessSet, bin_path, free_port, processes_with_token, python, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CATALOG = """
models:
  - name: tiny
    profiles:
      - {name: sim, engine: sim, replicas: 1}
"""


def test_honcho_start_runs_the_whole_system(tmp_path, no_leaked_processes):
    redis_port, gw_port, flower_port = free_port(), free_port(), free_port()
    env = {
        **FAST_ENV,
        "LLMGW_REDIS_PORT": str(redis_port),
        "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "LLMGW_GATEWAY_BIND": f"127.0.0.1:{gw_port}",
        "FLOWER_PORT": str(flower_port),
        "LLMGW_NODE": "solo",
        "LLMGW_GATEWAY_WORKERS": "1",
        # The Procfile names bare commands (celery, gunicorn, python), as a user's activated
        # virtualenv provides them; `make test` runs pytest without activating it.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    procs = ProcessSet(tmp_path / "logs")
    honcho = procs.start("honcho", [bin_path("honcho"), "-f", str(ROOT / "Procfile"), "-d", str(tmp_path), "start"],
                         env=env, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{gw_port}"
        wait_until(lambda: requests.get(url + "/healthz", timeout=1).ok, 60, what="the gateway")
        wait_until(lambda: requests.get(f"http://127.0.0.1:{flower_port}/", timeout=1).status_code == 200, 60,
                   what="Flower")
        (tmp_path / "catalog.yaml").write_text(CATALOG)
        subprocess.run([python(), "-m", "llmgw", "catalog", "apply", str(tmp_path / "catalog.yaml")],
                       env={**os.environ, **env}, check=True, capture_output=True, timeout=60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        wait_until(lambda: "tiny" in {m.id for m in client.models.list().data}, 60, what="tiny to be listed")
        resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert resp.choices[0].message.content
        # The batch role: a small batch through the Procfile's batch worker.
        lines = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}})
                        + "\n" for i in range(3))
        f = client.files.create(file=("b.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_until(lambda: (got := client.batches.retrieve(b.id)).status == "completed" and got, 60,
                          what="the batch to complete")
        assert done.request_counts.completed == 3
        assert (tmp_path / ".llmgw" / "redis").is_dir()  # the embedded Redis kept its data in the app dir

        honcho.signal_group(signal.SIGTERM)
        honcho.popen.wait(60)  # raises if honcho does not stop within the deadline
        # Stopping honcho stops every process it started, the engine (in its own session) included.
        wait_until(lambda: not processes_with_token(no_leaked_processes), 30,
                   what="every process of the Procfile, engines included, to exit")
    finally:
        procs.stop_all()
