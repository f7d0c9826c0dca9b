"""The batch worker on real processes (redis-server, a gunicorn gateway, `celery -A workers worker -Q
batch`, beat) against engines that hold their requests (tests/support/fake_upstream.py's gate) or
count real tokens (the sim engine): a cancel stops the sending within a second, a spent budget sends
the rest of the lines to the error file, and the end of the completion window expires what is left."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
import requests

from llmgw.state.records import EndpointInfo
from harness.procs import free_port, hold, python, wait_until

CHAT = "/v1/chat/completions"
FAST = {"LLMGW_BATCH_VIEW_INTERVAL": "0.1", "LLMGW_BATCH_SWEEP_INTERVAL": "1", "LLMGW_BATCH_LEASE_TTL": "2",
        "LLMGW_BATCH_DRAIN": "2", "LLMGW_GATEWAY_KEYS_INTERVAL": "0.2", "LLMGW_GATEWAY_USAGE_FLUSH": "0.1",
        "LLMGW_GATEWAY_REPORT_INTERVAL": "0.1"}


def lines(n: int, model: str = "m", max_tokens: int = 10) -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                                "body": {"model": model, "max_tokens": max_tokens,
                                         "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"
                    for i in range(n))


def system(cluster, url: str, capacity: int, **env) -> str:
    cluster.extra_env.update({**FAST, **env})
    cluster.start_redis()
    cluster.store().write_endpoints([EndpointInfo(id="e1", url=url, models=("m",), engine="sim", model="m",
                                                  served_name="m", capacity=capacity)], "fp", time.time())
    gw = cluster.start_gateway()
    cluster.start_batch_worker()
    cluster.start_beat()
    return gw


def ended(client, batch_id):
    b = client.batches.retrieve(batch_id)
    return b if b.status in ("completed", "failed", "expired", "cancelled") else None


def test_cancel_stops_the_sending_within_a_second_and_keeps_what_was_answered(cluster, upstreams):
    up = upstreams(gate=True, max_seqs=64, base=0.01)
    gw = system(cluster, up.url, capacity=10, LLMGW_BATCH_RESERVE="0.2")
    client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0, timeout=30)
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(50))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    # The engine holds every request: the batch fills the room its reserve leaves (8 of 10), no more.
    wait_until(lambda: up.stats["requests"] == 8, 30, what="8 lines in flight")
    # The gateway's report counts them as the feeder's (how it tells its lines from others', however
    # long they took to get there: workers/batch/decide.py).
    wait_until(lambda: [sum(r.feeders.values()) for r in cluster.store().gateway_reports()] == [8], 10,
               what="the gateway's report to count the feeder's 8 lines")
    hold(1.0, lambda: None)  # the load held: the feeder keeps to its room
    assert up.stats["requests"] == 8
    assert client.batches.retrieve(b.id).status == "in_progress"

    c = client.batches.cancel(b.id)
    assert c.status == "cancelling"
    up.open_gate()  # the 8 answer at once, and lines go on being sent until the feeder sees the cancel
    hold(1.0, lambda: None)  # the second the issue allows
    seen = up.stats["requests"]
    final = wait_until(lambda: ended(client, b.id), 30, what="the batch to be cancelled")
    hold(0.5, lambda: None)  # held to see that nothing follows
    assert up.stats["requests"] == seen < 50, "lines sent more than a second after the cancel"
    assert final.status == "cancelled" and final.cancelled_at >= final.cancelling_at
    assert (final.request_counts.completed, final.request_counts.failed) == (seen, 0)
    out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
    assert len(out) == seen and all(x["response"]["status_code"] == 200 for x in out)


def sim(cluster, capacity_args=("--max-seqs", "2")) -> str:
    port = free_port()
    cluster.procs.start("sim", [python(), "-m", "simengine", "--port", str(port), "--step-ms", "20",
                                "--served-model-name", "m", *capacity_args])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/health", timeout=1).ok, 15, what="the sim engine")
    return url


def test_a_spent_budget_sends_the_remaining_lines_to_the_error_file(cluster):
    cluster.start_redis()
    url = sim(cluster)
    cluster.extra_env.update({**FAST, "LLMGW_BATCH_RESERVE": "0"})
    cluster.store().write_endpoints([EndpointInfo(id="e1", url=url, models=("m",), engine="sim", model="m",
                                                  served_name="m", capacity=2)], "fp", time.time())
    gw = cluster.start_gateway()
    cluster.start_batch_worker()
    # The sim counts "hi" as 7 prompt tokens and answers exactly max_tokens: 17 tokens a line.
    key = cluster.llmgw("keys", "create", "team", "--budget", "60").stdout.strip()
    wait_until(lambda: requests.get(gw + "/v1/files", timeout=2).status_code == 401, 10, what="keys required")
    client = openai.OpenAI(base_url=gw + "/v1", api_key=key, max_retries=0, timeout=30)
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(20))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    final = wait_until(lambda: ended(client, b.id), 60, what="the batch to end")
    counts = final.request_counts
    assert final.status == "completed" and counts.completed + counts.failed == 20
    # Four lines cross 60 tokens; the feeder reads the budget every view, with two lines in flight.
    assert 4 <= counts.completed <= 8, counts
    errors = [json.loads(x) for x in client.files.content(final.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"budget_exceeded"} and len(errors) == counts.failed
    assert all(e["response"] is None for e in errors)
    store = cluster.store()
    [rec] = [k for k in store.list_keys() if k.name == "team"]
    assert int(store.key_usage(rec.id)["m:requests"]) == counts.completed  # billed: the answered ones only
    with pytest.raises(openai.RateLimitError, match="budget"):  # and no new batch while it is spent
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")


@pytest.mark.slow
def test_the_window_ends_and_the_unanswered_lines_expire(cluster, upstreams):
    up = upstreams(gate=True, max_seqs=64, base=0.01)
    gw = system(cluster, up.url, capacity=4, LLMGW_BATCH_RESERVE="0")
    client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0, timeout=30)
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(10))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1m")
    assert b.expires_at - b.created_at == 60
    wait_until(lambda: up.stats["requests"] == 4, 30, what="4 lines held by the engine")
    final = wait_until(lambda: ended(client, b.id), 90, interval=0.5, what="the window to end")
    assert final.status == "expired" and final.expired_at >= final.expires_at
    assert (final.request_counts.completed, final.request_counts.failed) == (0, 10)
    errors = [json.loads(x) for x in client.files.content(final.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == [f"c{i}" for i in range(10)]  # in the file's order
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    up.open_gate()  # the held lines answer now: too late, the batch is sealed
    hold(1.0, lambda: None)
    assert client.batches.retrieve(b.id).request_counts.completed == 0
