"""The simulated engine as a real process: OpenAI SDK calls, load numbers, fault injection."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import openai
import pytest
import requests

from llmgw.catalog import Profile
from llmgw.engines import get_engine
from llmgw.engines.metrics import read_load
from harness.procs import ProcessSet, free_port, python, wait_until

SIM = get_engine("sim")


@pytest.fixture
def procs(tmp_path):
    ps = ProcessSet(tmp_path / "logs")
    yield ps
    ps.stop_all()


def start(procs, *args, name="sim", ready=True):
    port = free_port()
    p = procs.start(name, [python(), "-m", "simengine", "--host", "127.0.0.1", "--port", str(port),
                           "--served-model-name", "sim-model", "sim-alias", *args])
    url = f"http://127.0.0.1:{port}"
    if ready:
        wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15,
                   what=f"sim /health 200\n{p.log()}")
    return p, url


def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)


def load(url, profile=Profile(name="s", engine="sim")):
    return read_load(requests.get(url + "/metrics", timeout=2).text, SIM, profile)


def test_openai_sdk_chat_completions_and_models(procs):
    _, url = start(procs, "--step-ms", "2")
    c = client(url)
    assert [m.id for m in c.models.list()] == ["sim-model", "sim-alias"]

    r = c.chat.completions.create(model="sim-alias", messages=[{"role": "user", "content": "hello there"}], max_tokens=7)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].message.content.split()) == 7
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0
    assert r.model == "sim-alias" and r.system_fingerprint == f"llmgw-sim-{url.rsplit(':', 1)[1]}"

    chunks = list(c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text.split()) == 5
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"

    t = c.completions.create(model="sim-model", prompt="once upon a time", max_tokens=4)
    assert len(t.choices[0].text.split()) == 4 and t.usage.prompt_tokens == 4

    default = c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}])
    assert default.usage.completion_tokens == 16 and default.choices[0].finish_reason == "stop"

    after = load(url)
    assert (after.running, after.waiting) == (0, 0)
    assert after.generation_tokens_total == 7 + 5 + 4 + 16
    assert after.prompt_tokens_total > 0 and after.kv_usage == 0.0


def test_sse_chunks_arrive_one_by_one(procs):
    _, url = start(procs, "--step-ms", "50")
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=10, headers={"X-Request-Id": "abc-1"},
                       json={"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
                             "stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["X-Request-Id"] == "abc-1"
        times, events = [], []
        for line in r.iter_lines():
            if line:
                times.append(time.monotonic())
                events.append(line)
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events)
    json.loads(events[1][6:])  # each event is one JSON chunk
    assert times[-2] - times[1] > 4 * 0.04  # tokens were spread over the steps, not buffered


def test_requests_beyond_max_seqs_wait_and_load_shows_it(procs):
    _, url = start(procs, "--max-seqs", "2", "--step-ms", "20")
    c = client(url)
    errors = []

    def one():
        try:
            c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=100)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    # 100 tokens at ~22 ms a step: the first two run for ~2 s while three wait, a window a slow poll
    # still hits (with 25 tokens it lasted ~0.5 s).
    threads = [threading.Thread(target=one) for _ in range(5)]
    try:
        for t in threads:
            t.start()
        # KV is held from the first decode step on (kv_usage is 0 for the instant before the prefill).
        seen = wait_until(
            lambda: (lambda l: l if (l.running, l.waiting) == (2, 3) and l.kv_usage > 0 else None)(load(url)),
            10, interval=0.01, what="2 running, 3 waiting, KV in use")
        assert seen.kv_usage < 1
    finally:
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a request never finished"
    assert not errors
    done = load(url)
    assert (done.running, done.waiting, done.generation_tokens_total) == (0, 0, 500)


def test_holds_many_concurrent_streams(procs):
    n = 120
    _, url = start(procs, "--max-seqs", "256", "--step-ms", "20", "--batch-alpha", "0")
    results: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n + 1)

    def one():
        s = requests.Session()
        with s.post(url + "/v1/chat/completions", stream=True, timeout=30, json={
                "model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 40,
                "stream": True}) as r:
            # Generous: on a loaded machine opening 120 connections can take a while; the point is that
            # they are all open at once, not how fast that happens.
            barrier.wait(60)
            count = sum(1 for line in r.iter_lines() if line.startswith(b"data: {"))
        with lock:
            results.append(count)

    threads = [threading.Thread(target=one) for _ in range(n)]
    try:
        for t in threads:
            t.start()
        barrier.wait(60)  # every stream is open at once
        assert load(url).running + load(url).waiting > 0
    finally:
        barrier.abort()  # harmless once passed; if the main thread failed first, it frees the streams
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream never finished"
    assert results == [41] * n  # role chunk + 40 tokens, for every stream


def test_client_disconnect_frees_the_slot(procs):
    _, url = start(procs, "--max-seqs", "1", "--step-ms", "20")
    r = requests.post(url + "/v1/chat/completions", stream=True, timeout=10, json={
        "model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10000, "stream": True})
    next(r.iter_lines())
    assert load(url).running == 1
    r.close()
    wait_until(lambda: load(url).running == 0, 5, what="the abandoned stream to be aborted")


def test_bad_requests_get_openai_style_errors(procs):
    _, url = start(procs, "--kv-tokens", "100")
    post = lambda body, **kw: requests.post(url + "/v1/chat/completions", timeout=5, **({"json": body} if body is not None else kw))  # noqa: E731
    r = post(None, data=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = post({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = post({"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 500})
    assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"]
    r = post({"model": "sim-model", "messages": [], "max_tokens": 5})
    assert r.status_code == 400
    assert requests.get(url + "/nowhere", timeout=5).status_code == 404


def test_llamacpp_metrics_style(procs):
    _, url = start(procs, "--metrics-style", "llamacpp", "--step-ms", "1")
    client(url).chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=3)
    text = requests.get(url + "/metrics", timeout=2).text
    assert "llamacpp:requests_processing 0" in text and "vllm:" not in text
    l = load(url, Profile(name="s", engine="sim", args=["--metrics-style", "llamacpp"]))
    assert (l.running, l.waiting, l.kv_usage, l.generation_tokens_total) == (0, 0, None, 3)


# --- fault injection -------------------------------------------------------------------------


def test_fail_start_exits_1_after_a_log_line(procs):
    p, _ = start(procs, "--fail-start", ready=False)
    assert p.popen.wait(10) == 1
    assert "failing at start" in p.log()


def test_startup_delay_refuses_connections_then_serves(procs):
    p, url = start(procs, "--startup-delay", "1.0", ready=False)
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=1)
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 10, what="health after delay")


def test_slow_start_answers_503_then_200(procs):
    # 5 s of loading: room for a slow start-up and two calls on a loaded machine, and still short.
    _, url = start(procs, "--slow-start", "5", ready=False)
    # (a tuple: a 503 Response is falsy)
    (first,) = wait_until(lambda: (requests.get(url + "/health", timeout=1),), 10, what="the port to open")
    assert first.status_code == 503 and first.json()["error"]["message"] == "Loading model"
    r = requests.post(url + "/v1/chat/completions", timeout=5, json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 30, what="health 200")


def test_crash_after_n_requests(procs):
    p, url = start(procs, "--crash-after", "2", "--step-ms", "1")
    c = client(url)
    for _ in range(2):
        c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert p.popen.wait(10) == 1
    assert "crashing after 2 requests" in p.log()


def test_error_rate_is_seeded(procs):
    def statuses(name):
        p, url = start(procs, "--error-rate", "0.5", "--seed", "7", "--step-ms", "1", name=name)
        out = [requests.post(url + "/v1/chat/completions", timeout=5, json={
            "model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code
            for _ in range(20)]
        p.stop()
        return out

    a, b = statuses("sim-a"), statuses("sim-b")
    assert a == b and set(a) == {200, 500}
    assert 3 <= a.count(500) <= 17


def test_sigterm_exits_cleanly_with_open_streams(procs):
    p, url = start(procs, "--step-ms", "50")
    r = requests.post(url + "/v1/chat/completions", stream=True, timeout=10, json={
        "model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": True})
    next(r.iter_lines())
    p.popen.send_signal(signal.SIGTERM)
    # The stream has ~50 s of tokens left: exiting 0 within wait()'s deadline means it did not drain them.
    assert p.popen.wait(10) == 0
    r.close()
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))


def test_port_in_use_exits_1_with_a_clear_line(procs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = procs.start("sim", [python(), "-m", "simengine", "--port", str(port)])
        assert p.popen.wait(10) == 1
    assert "cannot listen" in p.log()


def test_hang_after_keeps_http_up_but_stops_tokens(procs):
    p, url = start(procs, "--hang-after", "1", "--step-ms", "1")
    c = client(url)
    c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    before = load(url).generation_tokens_total
    out = {}

    def ask():
        try:
            c.with_options(timeout=3.0, max_retries=0).chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        except openai.APITimeoutError as e:
            out["timeout"] = e

    t = threading.Thread(target=ask)
    t.start()
    # While its client still waits (a client that left is aborted, as vLLM does): held, no token.
    wait_until(lambda: (lambda s: s.running + s.waiting >= 1)(load(url)), 2.5, interval=0.02,
               what="the request held by the hung engine")
    assert load(url).generation_tokens_total == before
    assert requests.get(url + "/health", timeout=2).status_code == 200
    t.join(10)
    assert "timeout" in out  # no answer ever came
    assert p.alive()


def test_api_key_guards_v1_only_and_headers_are_logged_without_tokens(procs):
    import hashlib

    p, url = start(procs, "--api-key", "engine-secret", "--log-headers", "--step-ms", "1")
    # like vLLM: /health and /metrics stay open, everything under /v1 needs the key
    assert requests.get(url + "/health", timeout=5).status_code == 200
    assert "vllm:num_requests_running" in requests.get(url + "/metrics", timeout=5).text
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "engine-secret"}):
        r = requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["message"] == "Unauthorized"
    assert requests.get(url + "/v1/models", timeout=5).status_code == 401
    ok = requests.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer engine-secret"},
                       timeout=5)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    digest = "sha256:" + hashlib.sha256(b"engine-secret").hexdigest()[:16]
    wait_until(lambda: f"Authorization: Bearer {digest}" in p.log(), 5, what="the headers in the log")
    assert "engine-secret" not in p.log()


def test_api_key_from_the_environment(procs):
    port = free_port()
    procs.start("sim", [python(), "-m", "simengine", "--port", str(port)], env={"SIMENGINE_API_KEY": "from-env"})
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15, what="sim /health 200")
    assert requests.get(url + "/v1/models", timeout=5).status_code == 401
    assert requests.get(url + "/v1/models", headers={"Authorization": "Bearer from-env"}, timeout=5).status_code == 200


# --- what each engine's personality does ----------------------------------------------------------


def _held_stream(url):
    """A stream sent while the only slot is busy: (seconds to its head, to its first content token)."""
    t0 = time.monotonic()
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=20, json={
            "model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}) as r:
        head = time.monotonic() - t0
        for line in r.iter_lines():
            if b'"content": "' in line and b'"content": ""' not in line:
                return head, time.monotonic() - t0
    raise AssertionError("no content token")


@pytest.mark.parametrize("style", ["vllm", "llamacpp"])
def test_stream_head_leaves_when_the_engine_it_stands_for_sends_it(procs, style):
    _, url = start(procs, "--max-seqs", "1", "--step-ms", "20", "--metrics-style", style)
    busy = threading.Thread(target=lambda: client(url).chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=40))
    busy.start()  # holds the only slot for ~0.8 s
    try:
        wait_until(lambda: load(url, Profile(name="s", engine="sim", args=["--metrics-style", style])).running == 1,
                   5, interval=0.01, what="the slot taken")
        head, first = _held_stream(url)
    finally:
        busy.join(30)
    assert first > 0.4  # it waited for the slot
    if style == "vllm":
        assert head < first / 2  # vLLM answers its head before the engine has the request
    else:
        assert head > 0.4  # llama-server writes nothing until its first token


def test_llamacpp_answers_report_the_prompt_their_slot_kept(procs):
    _, url = start(procs, "--metrics-style", "llamacpp", "--max-seqs", "2", "--step-ms", "1")
    system = {"role": "system", "content": "a long shared system prompt " * 20}
    first = requests.post(url + "/v1/chat/completions", timeout=10, json={
        "model": "sim-model", "messages": [system, {"role": "user", "content": "hi"}], "max_tokens": 5}).json()
    assert first["timings"]["cache_n"] == 0 and first["timings"]["prompt_n"] == first["usage"]["prompt_tokens"]
    history = [system, {"role": "user", "content": "hi"}, first["choices"][0]["message"],
               {"role": "user", "content": "and then?"}]
    second = requests.post(url + "/v1/chat/completions", timeout=10, json={
        "model": "sim-model", "messages": history, "max_tokens": 5}).json()
    kept = first["usage"]["prompt_tokens"] + 5 - 1  # its prompt and answer, all but the answer's last token
    assert second["timings"]["cache_n"] >= kept - 1 and second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    text = requests.get(url + "/metrics", timeout=2).text
    cached = float(text.split("\nllamacpp:prompt_tokens_cached_total ")[1].split()[0])
    assert cached == second["timings"]["cache_n"]


@pytest.mark.parametrize("policy, served", [("priority", ["high", "none", "low"]), ("fcfs", ["low", "none", "high"])])
def test_waiting_requests_are_served_in_priority_order(procs, policy, served):
    """vLLM's --scheduling-policy: under `priority` a request's `priority` (lower first) orders the
    waiting queue; under `fcfs` arrival does, and the field is accepted all the same."""
    _, url = start(procs, "--max-seqs", "1", "--step-ms", "5", "--scheduling-policy", policy)
    done: list[str] = []

    def send(name: str, max_tokens: int, priority: int | None) -> None:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": name}], "max_tokens": max_tokens,
                **({"priority": priority} if priority is not None else {})}
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        done.append(name)

    threads = [threading.Thread(target=send, args=("blocker", 150, 5))]
    threads[0].start()
    try:
        wait_until(lambda: load(url).running == 1, 10, interval=0.01, what="the blocker running")
        for i, (name, prio) in enumerate((("low", 2), ("none", None), ("high", -1))):
            threads.append(threading.Thread(target=send, args=(name, 3, prio)))
            threads[-1].start()
            wait_until(lambda: load(url).waiting == i + 1, 10, interval=0.01, what=f"{name} waiting")
    finally:
        for t in threads:
            t.join(60)
    assert done == ["blocker", *served]
    r = requests.post(url + "/v1/chat/completions", json={"model": "sim-model", "messages": [{"role": "user",
                      "content": "x"}], "max_tokens": 1, "priority": "high"}, timeout=10)
    assert r.status_code == 400 and "priority must be an integer" in r.text
