"""The Batch API's views on fakeredis (Flask's test client): uploads checked line by line and refused
whole, a key's files and batches its own, a batch planned from its file, cancelling."""

from __future__ import annotations

import io
import json

import pytest

from llmgw.state import keys
from tests.support.gateway_app import endpoint, make_app, server, store  # noqa: F401 - fixtures

CHAT = "/v1/chat/completions"


def jsonl(n: int, model: str = "m", start: int = 0) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT,
                                "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}).encode()
                    + b"\n" for i in range(start, start + n))


@pytest.fixture
def app(store, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LLMGW_BATCH_MAX_FILE_BYTES", "20000")
    _app, gw, client = make_app(store, [endpoint("e1", "http://127.0.0.1:9")], auth="auto")
    api = _app.extensions["llmgw.batches"]
    sent: list[str] = []
    api._send = sent.append
    return client, gw, sent


def upload(client, data: bytes, headers=None, name="in.jsonl", purpose="batch"):
    return client.post("/v1/files", data={"purpose": purpose, "file": (io.BytesIO(data), name)},
                       headers=headers or {}, content_type="multipart/form-data")


def test_upload_list_read_and_delete(app):
    client, gw, _ = app
    body = jsonl(3)
    r = upload(client, b"\n" + body)
    assert r.status_code == 200, r.json
    f = r.json
    assert (f["object"], f["purpose"], f["bytes"], f["filename"]) == ("file", "batch", len(body) + 1, "in.jsonl")
    assert client.get(f"/v1/files/{f['id']}").json == f
    assert [x["id"] for x in client.get("/v1/files").json["data"]] == [f["id"]]
    content = client.get(f"/v1/files/{f['id']}/content")
    assert content.data == b"\n" + body and content.headers["Content-Length"] == str(len(body) + 1)
    assert client.delete(f"/v1/files/{f['id']}").json == {"id": f["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{f['id']}").status_code == 404


def test_a_bad_upload_is_refused_whole_with_line_numbers(app, store):  # noqa: F811
    client, _, _ = app
    bad = jsonl(2) + b"{oops\n" + jsonl(1, start=0) + jsonl(1, model="other", start=5)
    r = upload(client, bad)
    assert r.status_code == 400
    msg = r.json["error"]["message"]
    assert "line 3: not valid JSON" in msg and "line 4: custom_id 'r0' repeats line 1" in msg
    assert "line 5: body.model 'other' differs from line 1's 'm'" in msg
    assert store.r.keys("llmgw:file*") == []  # nothing kept
    assert upload(client, jsonl(1), purpose="fine-tune").status_code == 400
    big = upload(client, jsonl(200))
    assert big.status_code == 413 and "LLMGW_BATCH_MAX_FILE_BYTES" in big.json["error"]["message"]
    assert store.r.keys("llmgw:file*") == []


def test_create_a_batch_from_its_file_and_cancel_it(app, store):  # noqa: F811
    client, _, sent = app
    fid = upload(client, jsonl(4)).json["id"]
    r = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": "24h",
                                         "metadata": {"run": "1"}})
    assert r.status_code == 200, r.json
    b = r.json
    assert (b["status"], b["request_counts"], b["model"], b["metadata"]) == (
        "validating", {"total": 4, "completed": 0, "failed": 0}, "m", {"run": "1"})
    assert sent == [b["id"]] and store.r.exists(keys.batch_queued(b["id"]))
    assert client.get(f"/v1/batches/{b['id']}").json["id"] == b["id"]
    assert [x["id"] for x in client.get("/v1/batches").json["data"]] == [b["id"]]
    # Its input file cannot go while it runs.
    assert "cancel it first" in client.delete(f"/v1/files/{fid}").json["error"]["message"]
    c = client.post(f"/v1/batches/{b['id']}/cancel").json
    assert c["status"] == "cancelling" and c["cancelling_at"]


def test_batch_refusals(app):
    client, _, _ = app
    fid = upload(client, jsonl(2, model="nope")).json["id"]
    r = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT})
    assert r.status_code == 404 and r.json["error"]["message"] == f"line 1 of {fid}: model 'nope' does not exist"
    r = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/embeddings"})
    assert r.status_code == 400 and "has url '/v1/chat/completions'" in r.json["error"]["message"]
    r = client.post("/v1/batches", json={"input_file_id": "file-missing", "endpoint": CHAT})
    assert r.status_code == 404


def test_keys_own_their_files_and_may_be_refused_batches(app, store):  # noqa: F811
    client, gw, _ = app
    _, a = store.create_key("a")
    _, b = store.create_key("b")
    _, c = store.create_key("c", batches=False)
    gw.keys.refresh()
    ha, hb, hc = ({"Authorization": f"Bearer {k}"} for k in (a, b, c))
    assert upload(client, jsonl(1)).status_code == 401
    fid = upload(client, jsonl(1), headers=ha).json["id"]
    assert client.get(f"/v1/files/{fid}", headers=hb).status_code == 404
    assert client.get("/v1/files", headers=hb).json["data"] == []
    r = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT}, headers=hb)
    assert r.status_code == 404
    denied = upload(client, jsonl(1), headers=hc)
    assert denied.status_code == 403 and denied.json["error"]["code"] == "batches_not_allowed"
    bid = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT}, headers=ha).json["id"]
    assert client.get(f"/v1/batches/{bid}", headers=hb).status_code == 404
    assert client.get(f"/v1/batches/{bid}", headers=ha).json["id"] == bid


def test_the_console_and_the_fleet_metrics_show_batches(app, store):  # noqa: F811
    from prometheus_client.parser import text_string_to_metric_families

    client, gw, _ = app
    fid = upload(client, jsonl(4)).json["id"]
    bid = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT}).json["id"]
    store.update_batch(bid, in_progress_at=gw.clock.time(), progress=[[100.0, 0], [110.0, 2]])
    store.record_line(bid, 0, True, "{}")
    store.record_line(bid, 1, False, "{}")
    [row] = client.get("/ui/api/batches").json["batches"]
    assert (row["id"], row["status"], row["done"], row["failed"], row["rate"], row["owner"]) == (
        bid, "in_progress", 2, 1, 0.2, "anonymous")
    assert row["eta_seconds"] == 10  # 2 lines left at 0.2 a second
    text = client.get("/metrics/fleet").get_data(as_text=True)
    samples = {(s.name, tuple(s.labels.values())): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name.startswith("llmgw_batch")}
    assert samples[("llmgw_batches", ("in_progress",))] == 1
    assert samples[("llmgw_batch_requests", ("waiting",))] == 2
    assert samples[("llmgw_batches_ended_total", ("completed",))] == 0
