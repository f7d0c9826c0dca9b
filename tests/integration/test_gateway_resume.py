"""An answer survives its engine (gateway.http.resume) on real simulated engines: kill -9 one mid-answer,
stop it (SIGSTOP: a hang), or let it close its streams early, and every answer still arrives whole,
spliced without a lost or repeated token: the same text, token for token, as an undisturbed answer
(the simulated engine's answer is a function of the request, and it continues an assistant message
as vLLM and llama-server do). Streamed and not; chat, completions; Responses streams, which are not
resumed, end with an error event instead of a silent close; so do answers a resume could not
continue exactly (logprobs), and every answer of a model whose catalog turns resuming off."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from gateway.config import RoutingConfig
from llmgw import surface
from llmgw.state.records import EndpointInfo
from tests.support.gateway_app import make_app, metric, server, store  # noqa: F401
from harness.procs import ProcessSet, free_port, python, wait_until

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
TOKENS = 24


@pytest.fixture
def procs(tmp_path):
    ps = ProcessSet(tmp_path / "logs")
    yield ps
    for p in ps.procs:
        p.signal_group(signal.SIGCONT)  # a stopped engine would wait out SIGTERM's grace
    ps.stop_all()


def sim(procs, name, *args, style="vllm"):
    port = free_port()
    p = procs.start(name, [python(), "-m", "simengine", "--host", "127.0.0.1", "--port", str(port),
                           "--served-model-name", "m", "--metrics-style", style, *args])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, 15, what=f"{name} up\n{p.log()}")
    return p, url


def ep(i, url, engine="sim", resume=True, capacity=64, **kw):
    return EndpointInfo(id=i, url=url, models=("m",), engine=engine, served_name="m", model="m", capacity=capacity,
                        resume=resume, **kw, paths=surface.same_paths(surface.CHAT, surface.COMPLETIONS, surface.RESPONSES))


def gateway(store, eps, **cfg):  # noqa: F811
    cfg.setdefault("routing", RoutingConfig(stale_after=3600, eject_for=30))
    _, gw, client = make_app(store, eps, **cfg)
    return gw, client


def chat_body(i, stream=True, **kw):
    return {"model": "m", "messages": [{"role": "user", "content": f"question number {i}, please"}],
            "max_tokens": TOKENS, "stream": stream, **kw}


def events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line[6:] != "[DONE]":
                out.append(json.loads(line[6:]))
    return out


def streamed_text(text: str, chat=True) -> str:
    return "".join((c["delta"].get("content") or "") if chat else c["text"]
                   for e in events(text) for c in e.get("choices", ()))


def reference(url, path, body) -> dict:
    """The undisturbed answer, straight from an engine (not streamed)."""
    return requests.post(url + path, json={**body, "stream": False}, timeout=30).json()


def check_stream(text: str, want: str, chat=True):
    evs = events(text)
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    assert not any("error" in e for e in evs), [e for e in evs if "error" in e]
    assert streamed_text(text, chat) == want  # no token lost or repeated at the seam
    assert len({e["id"] for e in evs}) == 1  # one id
    finishes = [c["finish_reason"] for e in evs for c in e.get("choices", ()) if c.get("finish_reason")]
    assert finishes == ["length"]
    if chat:
        assert sum(1 for e in evs for c in e.get("choices", ()) if "role" in c.get("delta", {})) == 1


def started(gw_client, path, body, out, key):
    """Send `body` from a thread; its answer lands in out[key]."""
    def run():
        r = gw_client.post(path, json=body)
        out[key] = (r.status_code, r.get_data(as_text=True), r.headers.get("X-LLMGW-Endpoint"))
    t = threading.Thread(target=run)
    t.start()
    return t


def engine_metric(url, *names) -> float:
    """The first of `names` an engine's /metrics has (vLLM's or llama-server's), whatever its labels."""
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            return float(line.split()[-1])
    return 0.0


def running(url) -> float:
    return engine_metric(url, "vllm:num_requests_running", "llamacpp:requests_processing")


def generated(url) -> float:
    return engine_metric(url, "vllm:generation_tokens_total", "llamacpp:tokens_predicted_total")


@pytest.mark.parametrize("style", ["vllm", "llamacpp"])
def test_kill_9_mid_stream_resumes_every_stream_token_for_token(procs, store, style):  # noqa: F811
    p1, u1 = sim(procs, "e1", "--step-ms", "40", "--max-seqs", "32", style=style)
    _, u2 = sim(procs, "e2", "--step-ms", "5", "--max-seqs", "32", style=style)
    gw, c = gateway(store, [ep("e1", u1)])  # the first answers go to e1 only
    n = 6
    bodies = [chat_body(i) for i in range(n)] + [
        {"model": "m", "prompt": f"once upon a time {i}", "max_tokens": TOKENS, "stream": True} for i in range(2)]
    want = [reference(u2, CHAT, b)["choices"][0]["message"]["content"] for b in bodies[:n]]
    want += [reference(u2, COMPLETIONS, b)["choices"][0]["text"] for b in bodies[n:]]
    store.write_endpoints([ep("e1", u1), ep("e2", u2)], "fp2", 0)
    out: dict = {}
    threads = []
    for i, b in enumerate(bodies):
        threads.append(started(c, CHAT if i < n else COMPLETIONS, b, out, i))
    wait_until(lambda: running(u1) == len(bodies), 10, what="every stream running on e1")
    wait_until(lambda: generated(u1) >= 4 * len(bodies), 10, what="a few tokens of each sent")
    gw.refresh()  # e2 is routable now; every stream is mid-answer on e1
    p1.kill9()
    for t in threads:
        t.join(30)
    for i, want_text in enumerate(want):
        status, text, _ = out[i]
        assert status == 200
        check_stream(text, want_text, chat=i < n)
    page = c.get("/metrics").get_data(as_text=True)
    assert metric(page, 'llmgw_gateway_stream_resumes_total{model="m",outcome="resumed",reason="reset"}') == len(bodies)


def test_a_whole_answer_whose_engine_dies_is_asked_for_again(procs, store):  # noqa: F811
    """llama.cpp endpoints are read as streams even for whole answers (gateway.upstream.assemble): the
    head came, so it is past the first-byte retry; the whole request goes to the other replica."""
    p1, u1 = sim(procs, "e1", "--step-ms", "40", style="llamacpp")
    _, u2 = sim(procs, "e2", "--step-ms", "5", style="llamacpp")
    gw, c = gateway(store, [ep("e1", u1, engine="llamacpp")])
    want = reference(u2, CHAT, chat_body(0))["choices"][0]["message"]["content"]
    store.write_endpoints([ep("e1", u1, engine="llamacpp"), ep("e2", u2, engine="llamacpp")], "fp2", 0)
    out: dict = {}
    t = started(c, CHAT, chat_body(0, stream=False), out, 0)
    wait_until(lambda: generated(u1) >= 3, 10, what="tokens generated on e1")
    gw.refresh()
    p1.kill9()
    t.join(30)
    status, text, endpoint = out[0]
    assert status == 200 and endpoint == "e2", text
    assert json.loads(text)["choices"][0]["message"]["content"] == want


def test_a_hung_engine_is_left_after_the_stall_limit(procs, store):  # noqa: F811
    p1, u1 = sim(procs, "e1", "--step-ms", "40")
    _, u2 = sim(procs, "e2", "--step-ms", "5")
    gw, c = gateway(store, [ep("e1", u1)], stall_timeout=0.5)
    want = reference(u2, CHAT, chat_body(1))["choices"][0]["message"]["content"]
    store.write_endpoints([ep("e1", u1), ep("e2", u2)], "fp2", 0)
    out: dict = {}
    t = started(c, CHAT, chat_body(1), out, 0)
    wait_until(lambda: generated(u1) >= 3, 10, what="tokens on e1")
    gw.refresh()
    p1.signal_group(signal.SIGSTOP)
    t.join(30)
    check_stream(out[0][1], want)
    page = c.get("/metrics").get_data(as_text=True)
    assert metric(page, 'llmgw_gateway_stream_resumes_total{model="m",outcome="resumed",reason="stall"}') == 1


def test_an_engine_that_closes_its_streams_early_is_spliced_over(procs, store):  # noqa: F811
    _, u1 = sim(procs, "e1", "--step-ms", "5", "--close-early", "7")
    _, u2 = sim(procs, "e2", "--step-ms", "5")
    gw, c = gateway(store, [ep("e1", u1), ep("e2", u2)])
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: c.post(CHAT, json=chat_body(i)).get_data(as_text=True), range(8)))
    for i, text in enumerate(answers):
        check_stream(text, reference(u2, CHAT, chat_body(i))["choices"][0]["message"]["content"])
    page = c.get("/metrics").get_data(as_text=True)
    assert metric(page, 'llmgw_gateway_stream_resumes_total{model="m",outcome="resumed",reason="closed"}') >= 1


def test_an_answer_moves_as_often_as_its_engines_break_it_up_to_the_bound(procs, store):  # noqa: F811
    """Both engines give up after 7 tokens: a 24-token answer takes three resumes, back and forth,
    and is still its undisturbed self; with the bound at 2 the third break ends it with an error event."""
    _, u1 = sim(procs, "e1", "--step-ms", "5", "--close-early", "7")
    _, u2 = sim(procs, "e2", "--step-ms", "5", "--close-early", "7")
    _, ref = sim(procs, "ref", "--step-ms", "1")
    want = reference(ref, CHAT, chat_body(3))["choices"][0]["message"]["content"]
    _, c = gateway(store, [ep("e1", u1), ep("e2", u2)], resumes=5)
    check_stream(c.post(CHAT, json=chat_body(3)).get_data(as_text=True), want)
    page = c.get("/metrics").get_data(as_text=True)
    assert metric(page, 'llmgw_gateway_stream_resumes_total{model="m",outcome="resumed",reason="closed"}') == 3
    _, c2 = gateway(store, [ep("e1", u1), ep("e2", u2)], resumes=2)
    text = c2.post(CHAT, json=chat_body(3)).get_data(as_text=True)
    assert want.startswith(streamed_text(text)) and len(streamed_text(text)) == 4 * 21
    assert "at most 2 resumes" in events(text)[-1]["error"]["message"]


def test_what_cannot_be_resumed_exactly_ends_with_an_error_event(procs, store):  # noqa: F811
    _, u1 = sim(procs, "e1", "--step-ms", "5", "--close-early", "5")
    gw, c = gateway(store, [ep("e1", u1)])  # a resume is refused before any other replica is looked for
    for path, body, why in [
        (CHAT, chat_body(0, logprobs=True), "logprobs"),
        (RESPONSES, {"model": "m", "input": "hello", "max_output_tokens": TOKENS, "stream": True}, "Responses"),
    ]:
        r = c.post(path, json=body)
        text = r.get_data(as_text=True)
        errors = [e for e in events(text) if "error" in e or e.get("type") == "error"]
        assert r.status_code == 200 and len(errors) == 1, text[-500:]
        message = errors[0]["error"]["message"] if "error" in errors[0] else errors[0]["message"]
        assert why in message


def test_a_model_whose_catalog_turns_resuming_off_gets_an_error_event(procs, store):  # noqa: F811
    _, u1 = sim(procs, "e1", "--step-ms", "5", "--close-early", "5")
    _, u2 = sim(procs, "e2", "--step-ms", "5")
    gw, c = gateway(store, [ep("e1", u1, resume=False)])
    text = c.post(CHAT, json=chat_body(0)).get_data(as_text=True)
    evs = events(text)
    assert streamed_text(text) and evs[-1]["error"]["code"] == "stream_resume_refused"
    assert "routing.resume" in evs[-1]["error"]["message"]


def test_each_hop_is_an_attempt_span_and_the_broken_one_says_why(procs, store, traced):  # noqa: F811
    t, exporter = traced
    _, u1 = sim(procs, "e1", "--step-ms", "5", "--close-early", "5")
    _, u2 = sim(procs, "e2", "--step-ms", "5")
    _, c = gateway(store, [ep("e1", u1, priority=1), ep("e2", u2)], tracing=t)  # e1's tier first
    assert streamed_text(c.post(CHAT, json=chat_body(0)).get_data(as_text=True))
    spans = exporter.get_finished_spans()
    attempts = sorted((s for s in spans if s.name == "llmgw.upstream_attempt"), key=lambda s: s.start_time)
    assert [a.attributes["llmgw.endpoint"] for a in attempts] == ["e1", "e2"]
    assert attempts[0].attributes["llmgw.outcome"] == "broken:closed" and attempts[0].attributes["llmgw.retried"]
    assert attempts[1].attributes["llmgw.outcome"] == "answer" and attempts[1].attributes["llmgw.attempt"] == 1
    (root,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert root.attributes["llmgw.completed"] is True


def test_an_explained_answer_says_which_replica_it_went_on_from(procs, store):  # noqa: F811
    """X-LLMGW-Explain (the console's playground): the record names the replica that broke off, why,
    and the one that finished the answer (gateway.observe.explain)."""
    _, u1 = sim(procs, "e1", "--step-ms", "5", "--close-early", "5")
    _, u2 = sim(procs, "e2", "--step-ms", "5")
    _, c = gateway(store, [ep("e1", u1, priority=1), ep("e2", u2)])  # e1's tier first
    r = c.post(CHAT, json=chat_body(0, stream_options={"include_usage": True}), headers={"X-LLMGW-Explain": "1"})
    assert streamed_text(r.get_data(as_text=True))
    rec = c.get("/v1/llmgw/requests/" + r.headers["X-Request-Id"]).json
    assert r.headers["X-LLMGW-Endpoint"] == rec["header_endpoint"] == "e1" and rec["served_by"]["replica"] == "e2"
    assert [s["kind"] for s in rec["steps"]] == ["choice", "attempt", "failed", "choice", "attempt"]
    assert rec["steps"][2]["outcome"] == "broken:closed" and rec["completed"] and rec["usage"][1] == TOKENS
    assert "Its engine broke off after the first byte (closed): the answer went on from another replica." \
        in rec["explanation"]
    assert rec["explanation"][-1].startswith("Served by replica e2 (sim): HTTP 200, ")
