"""The Batch API end to end, driven by the official `openai` client on a whole system (Redis with its
append-only file, control worker, beat, a node agent with two sim replicas, the gateway, a batch
worker), with an API key: `files.create`, `batches.create`, `batches.retrieve` until done,
`files.content`. Midway one process is killed (kill -9) and started again: the batch worker, the
gateway, or Redis. Every line is answered exactly once in the output file, and billed once to the
key, however many lines were sent twice."""

from __future__ import annotations

import io
import json
import signal
import time

import openai
import pytest
import requests

from llmgw.state.store.batches import BATCH_KEY_NAME
from harness.cluster import FAST_AGENT, sim_catalog
from harness.procs import wait_until

pytestmark = pytest.mark.slow

LINES = 600
CATALOG = sim_catalog(replicas=2, model="chat", capacity=16, args=["--step-ms", "20"])
BATCH_ENV = {"LLMGW_BATCH_LEASE_TTL": "2", "LLMGW_BATCH_SWEEP_INTERVAL": "1", "LLMGW_BATCH_VIEW_INTERVAL": "0.25",
             "LLMGW_BATCH_SLICE": "20"}
GATEWAY_ENV = {"LLMGW_GATEWAY_KEYS_INTERVAL": "0.2", "LLMGW_GATEWAY_USAGE_FLUSH": "0.1"}
ENDED = ("completed", "failed", "expired", "cancelled")


def requests_file(n: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "chat", "max_tokens": 24,
                                         "messages": [{"role": "user", "content": f"question {i}"}]}}).encode() + b"\n"
                    for i in range(n))


def retrieve(client, batch_id):
    """The batch as the client sees it; None while the system is coming back (503s, refused)."""
    try:
        return client.batches.retrieve(batch_id)
    except (openai.APIError, openai.APIConnectionError):
        return None


@pytest.mark.parametrize("victim", ["batch-worker", "gateway", "redis"])
def test_every_line_answered_once_after_a_process_is_killed(cluster, victim):
    cluster.extra_env.update(BATCH_ENV)
    cluster.start_redis(persistent=True)
    [url] = cluster.start_system(CATALOG, nodes=("a",), node_env=FAST_AGENT, routed=2, gateway_env=GATEWAY_ENV)
    cluster.start_batch_worker()
    key = cluster.llmgw("keys", "create", "team").stdout.strip()
    wait_until(lambda: requests.get(url + "/v1/files", timeout=2).status_code == 401, 10,
               what="the gateway to require keys")
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)

    f = client.files.create(file=("questions.jsonl", io.BytesIO(requests_file(LINES))), purpose="batch")
    assert (f.purpose, f.bytes) == ("batch", len(requests_file(LINES)))
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"victim": victim})
    assert batch.status == "validating" and batch.request_counts.total == LINES

    def done() -> int:
        b = retrieve(client, batch.id)
        return b.request_counts.completed + b.request_counts.failed if b is not None else 0

    wait_until(lambda: done() >= LINES // 4, 120, interval=0.2, what="a quarter of the lines answered")
    assert done() < LINES, "the batch ended before the kill: make it longer"
    if victim == "batch-worker":
        cluster.procs.get("batch").kill9()
        cluster.start_batch_worker(name="batch2")
    elif victim == "gateway":
        gw = cluster.procs.get("gateway")
        gw.signal_group(signal.SIGKILL)
        gw.popen.wait(10)
        cluster.start_gateway(port=int(url.rsplit(":", 1)[1]), name="gateway-again", **GATEWAY_ENV)
    else:
        cluster.kill_redis()
        time.sleep(1)  # the outage (a fault held, not a wait for a condition)
        cluster.restart_redis()

    final = wait_until(lambda: (b := retrieve(client, batch.id)) is not None and b.status in ENDED and b, 180,
                       interval=0.5, what=f"the batch to end after the {victim} was killed")
    assert final.status == "completed", final
    assert (final.request_counts.completed, final.request_counts.failed) == (LINES, 0)
    assert final.error_file_id is None and final.output_file_id

    lines = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
    ids = [x["custom_id"] for x in lines]
    assert len(ids) == LINES and set(ids) == {f"req-{i}" for i in range(LINES)}, "every line exactly once"
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in lines)
    tokens = sum(x["response"]["body"]["usage"]["total_tokens"] for x in lines)
    assert final.usage.total_tokens == tokens

    # Billed once: the key's usage counts each line once, whatever was sent again after the kill.
    store = cluster.store()
    [rec] = [k for k in store.list_keys() if k.name == "team"]
    usage = store.key_usage(rec.id)
    assert int(usage["chat:requests"]) == LINES
    assert int(usage["chat:prompt"]) + int(usage["chat:completion"]) == tokens
    # What the gateways served the batch workers, re-sent lines included, is counted under the workers'
    # own key (less what a killed gateway had not flushed yet).
    [svc] = [k for k in store.list_keys() if k.name == BATCH_KEY_NAME]
    assert svc.priority == "batch"
    print(f"{victim}: {LINES} lines; the gateways served the batch workers {store.key_usage(svc.id)['chat:requests']}")
