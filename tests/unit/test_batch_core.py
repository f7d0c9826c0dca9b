"""The Batch API's pure parts: the input file's checks, a new batch's rules, the derived status, the
feeder's decisions (room, allowance, what an answer means, what a run does next)."""

from __future__ import annotations

import json

import pytest

from llmgw.batch.lines import Chunker, FileChecker, Limits, requests_in, summary
from llmgw.batch.rules import Refusal, owner_refusal, parse_window, plan_batch
from llmgw.batch.shapes import answer_line, batch_object, error_line, usage_of
from llmgw.state.batch_records import BatchRecord, FileRecord, status
from llmgw.state.demand_records import EndpointUse, GatewayReport, ModelDemand
from llmgw.state.keypolicy import ApiKeyRecord
from llmgw.state.records import EndpointInfo, LoadRecord
from workers.batch.decide import (
    Again, Drain, Feed, Finish, GiveUp, Keep, Nothing, Room, Seal, Throttle, allowance, judge, learn_slots, room,
    step,
)

LIMITS = Limits(max_file_bytes=10_000, max_requests=5, max_line_bytes=400)


def line(cid="a", model="m", url="/v1/chat/completions", **body) -> bytes:
    return (json.dumps({"custom_id": cid, "method": "POST", "url": url,
                        "body": {"model": model, "messages": [], **body}}) + "\n").encode()


def check(*lines: bytes, limits=LIMITS) -> FileChecker:
    c = FileChecker(limits)
    for raw in lines:
        c.line(raw)
    return c


# --- the input file ---------------------------------------------------------------------------------
def test_a_good_file_has_no_problem_and_says_what_it_names():
    c = check(b"\n", line("a"), b"  \r\n", line("b"))
    assert c.finish() == []
    assert (c.requests, c.endpoint, c.model, c.first_line, c.lineno) == (2, "/v1/chat/completions", "m", 2, 4)


@pytest.mark.parametrize("raw,code,where", [
    (b"{not json\n", "invalid_json_line", "line 2: not valid JSON"),
    (b"[1]\n", "invalid_json_line", "line 2: expected a JSON object, got list"),
    (b"\xff\xfe\n", "invalid_json_line", "line 2: not UTF-8 text"),
    (line("a"), "duplicate_custom_id", "line 2: custom_id 'a' repeats line 1"),
    (line(""), "missing_custom_id", "line 2: custom_id: expected a non-empty string"),
    (line("b", model="other"), "mismatched_model", "line 2: body.model 'other' differs from line 1's 'm'"),
    (line("b", url="/v1/embeddings"), "mismatched_url", "line 2: url '/v1/embeddings' differs from line 1's"),
    (line("b", url="/v1/images"), "invalid_url", "line 2: url: expected one of"),
    (line("b", stream=True), "invalid_body", "line 2: body.stream"),
    (json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/chat/completions",
                 "body": {"model": "m"}}).encode(), "invalid_method", "line 2: method"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions"}).encode(), "missing_body",
     "line 2: body: expected a JSON object"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {}}).encode(),
     "missing_model", "line 2: body.model"),
    (b'{"x": "' + b"y" * 500 + b'"}\n', "line_too_large", "line 2: 509 bytes"),
])
def test_each_bad_line_is_named_with_its_reason(raw, code, where):
    problems = check(line("a"), raw).finish()
    assert [p.code for p in problems] == [code]
    assert summary(problems).startswith(where), summary(problems)


def test_limits_on_requests_and_bytes():
    many = check(*[line(str(i)) for i in range(7)])
    assert [p.code for p in many.finish()] == ["too_many_requests"]
    big = check(*[line(str(i)) for i in range(3)], limits=Limits(100, 5, 400))
    assert big.too_large and big.finish()[0].code == "file_too_large"
    assert check().finish()[0].code == "empty_file"


def test_problems_are_capped_and_counted():
    c = check(*[b"nope\n"] * 30, limits=Limits(10_000, 50, 400))
    problems = c.finish()
    assert len(problems) == 21 and problems[-1].message == "and 10 more problems"
    assert summary(problems).endswith("; and 16 more")


def test_chunks_hold_whole_lines_as_sent_and_read_back_in_order():
    raws = [line(f"r{i}", messages=[{"role": "user", "content": "\u2028x" * i}]) for i in range(40)]
    raws.insert(3, b"\r\n")
    chunker, chunks = Chunker(target=300), []
    for raw in raws:
        if (out := chunker.add(raw.decode(), len(raw))) is not None:
            chunks.append(out)
    chunks.append(chunker.flush())
    assert "".join(chunks).encode() == b"".join(raws) and chunker.chunks == len(chunks) > 5
    got = list(requests_in(chunks))
    assert [(r.index, r.custom_id) for r in got] == [(i, f"r{i}") for i in range(40)]


# --- a new batch --------------------------------------------------------------------------------------
FILE = FileRecord("file-1", "k1", "in.jsonl", "batch", 100, 1.0, requests=3, endpoint="/v1/chat/completions",
                  model="m", first_line=1)


def test_plan_batch_takes_the_file_and_the_window():
    b = plan_batch({"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h",
                    "metadata": {"team": "a"}}, FILE, "k1", 1000.0, "batch_x")
    assert isinstance(b, BatchRecord)
    assert (b.total, b.model, b.expires_at, b.metadata, b.status) == (3, "m", 1000.0 + 86400, {"team": "a"}, "validating")


@pytest.mark.parametrize("body,file,kind,text", [
    ({"endpoint": "/v1/chat/completions"}, FILE, "bad_request", "input_file_id"),
    ({"input_file_id": "file-1", "endpoint": "/v1/x"}, FILE, "bad_request", "endpoint: expected one of"),
    ({"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "soon"}, FILE,
     "bad_request", "completion_window"),
    ({"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "8d"}, FILE,
     "bad_request", "from 1m to 7d"),
    ({"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "metadata": {"k": 1}}, FILE, "bad_request",
     "metadata.k"),
    ({"input_file_id": "file-1", "endpoint": "/v1/chat/completions"}, None, "not_found", "no file 'file-1'"),
    ({"input_file_id": "file-1", "endpoint": "/v1/embeddings"}, FILE, "bad_request", "has url '/v1/chat/completions'"),
])
def test_plan_batch_refusals_name_the_field(body, file, kind, text):
    r = plan_batch(body, file, "k1", 1.0, "b")
    assert isinstance(r, Refusal) and r.kind == kind and text in r.message, r


def test_window_parses_minutes_hours_days():
    assert parse_window("24h") == 86400 and parse_window("30m") == 1800 and parse_window(" 2d ") == 172800
    assert isinstance(parse_window("30s"), Refusal) and isinstance(parse_window(24), Refusal)


def batch(**kw) -> BatchRecord:
    base = dict(id="b", owner="k1", endpoint="/v1/chat/completions", input_file_id="f", completion_window="24h",
                created_at=0.0, expires_at=100.0, total=10, model="m")
    return BatchRecord(**{**base, **kw})


@pytest.mark.parametrize("facts,expected", [
    ({}, "validating"),
    ({"in_progress_at": 1.0}, "in_progress"),
    ({"in_progress_at": 1.0, "finalizing_at": 2.0}, "finalizing"),
    ({"in_progress_at": 1.0, "finalizing_at": 2.0, "completed_at": 3.0}, "completed"),
    ({"in_progress_at": 1.0, "cancelling_at": 2.0}, "cancelling"),
    ({"in_progress_at": 1.0, "cancelling_at": 2.0, "finalizing_at": 3.0}, "cancelling"),
    ({"in_progress_at": 1.0, "cancelling_at": 2.0, "cancelled_at": 3.0}, "cancelled"),
    ({"in_progress_at": 1.0, "finalizing_at": 2.0, "expired_at": 3.0}, "expired"),
    ({"failed_at": 1.0}, "failed"),
])
def test_status_is_derived_from_the_facts(facts, expected):
    assert status(batch(**facts)) == expected


def key(**kw) -> ApiKeyRecord:
    return ApiKeyRecord("k1", "team", "h", **kw)


@pytest.mark.parametrize("k,used,code", [
    (key(), 0, None),
    (None, 0, "invalid_api_key"),
    (key(expires_at=5.0), 0, "expired_api_key"),
    (key(batches=False), 0, "batches_not_allowed"),
    (key(models=("other",)), 0, "model_not_found"),
    (key(models=("alias",)), 0, None),
    (key(budget=100, budget_period="day"), 99, None),
    (key(budget=100, budget_period="day"), 100, "budget_exceeded"),
])
def test_owner_refusal_follows_the_key(k, used, code):
    got = owner_refusal(batch(), k, frozenset({"m", "alias"}), used, 10.0)
    assert (got[0] if got else None) == code
    assert owner_refusal(batch(owner="anonymous"), None, frozenset({"m"}), 0, 10.0) is None


def test_shapes_are_openais():
    o = batch_object(batch(in_progress_at=1.5, n_completed=3, n_failed=1, prompt_tokens=10, completion_tokens=5))
    assert o["status"] == "in_progress" and o["request_counts"] == {"total": 10, "completed": 3, "failed": 1}
    assert o["usage"]["total_tokens"] == 15 and o["in_progress_at"] == 1 and o["errors"] is None
    ok = json.loads(answer_line("b", 0, "c0", 200, "rid", {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}))
    assert ok["custom_id"] == "c0" and ok["error"] is None and ok["response"]["status_code"] == 200
    bad = json.loads(answer_line("b", 1, "c1", 400, "rid", {"error": {"code": "x", "message": "no"}}))
    assert bad["error"] == {"code": "x", "message": "no"} and bad["response"]["status_code"] == 400
    gone = json.loads(error_line("b", 2, "c2", "batch_expired", "late"))
    assert gone["response"] is None and gone["error"]["code"] == "batch_expired"
    assert usage_of({"usage": {"input_tokens": 2, "output_tokens": 9}}) == (2, 9) and usage_of("text") == (0, 0)


# --- the feeder's decisions -----------------------------------------------------------------------------
def ep(eid, cap=10, model="m"):
    return EndpointInfo(id=eid, url=f"http://{eid}", models=(model, "alias"), engine="sim", capacity=cap, model=model)


def load(eid, running, waiting=0, ts=100.0, ok=True):
    return LoadRecord(eid, ts, ok, running=running, waiting=waiting)


def report(**inflight):
    return GatewayReport("g", 100.0, endpoints={k: EndpointUse(v) for k, v in inflight.items()})


def test_room_leaves_the_reserve_and_counts_what_the_gateways_hold():
    eps = [ep("a"), ep("b"), ep("x", model="other")]
    # a: the gateways hold 6 (a scrape a second old said 4): 9 - 6. b: its engine queues one: none.
    r = room("m", eps, {"a": load("a", 4), "b": load("b", 7, 1)}, [report(a=6, b=2)], 100.0, 0.1, {})
    assert r == Room(free=(9 - 6) - 1, endpoints=2, at=100.0)
    # Without a gateway's report, the scrapes: a holds 4, b 8 and queues one.
    assert room("m", eps, {"a": load("a", 4, ts=99.0), "b": load("b", 7, 1)}, [], 100.0, 0.1, {}) == \
        Room(free=5 - 1, endpoints=2, at=99.0)
    stale = room("m", eps, {"a": load("a", 4, ts=90.0)}, [], 100.0, 0.1, {})
    assert stale.free == 18  # a stale scrape says nothing; nothing reported: all of it is room


def test_queued_standard_requests_leave_no_room():
    rep = GatewayReport("g", 100.0, models={"m": ModelDemand(inflight=5, queued=3)})
    assert room("m", [ep("a")], {}, [rep], 100.0, 0.1, {}).free == -3


def test_room_without_capacity_probes_one_at_a_time():
    eps = [ep("a", cap=None)]
    assert room("m", eps, {"a": load("a", 3)}, [], 100.0, 0.0, {}).free == 1
    assert room("m", eps, {"a": load("a", 3, waiting=2)}, [], 100.0, 0.0, {}).free == -2
    seen = learn_slots({}, {"a": load("a", 6)})
    assert seen == {"a": 6} and room("m", eps, {"a": load("a", 3)}, [], 100.0, 0.0, seen).free == 3


def test_the_room_counts_the_feeders_own_lines_by_identity():
    feeders = {"f-me": 5, "f-other": 2}
    reps = [GatewayReport("g1", 100.0, endpoints={"a": EndpointUse(6)}, feeders={"f-me": 3}),
            GatewayReport("g2", 100.0, endpoints={"a": EndpointUse(3)}, feeders=feeders)]
    r = room("m", [ep("a")], {}, reps, 100.0, 0.1, {}, feeder="f-me")
    assert (r.free, r.mine) == (9 - 9, 3 + 5)  # its 8 of the 9 held: the room is its own
    assert room("m", [ep("a")], {}, reps, 100.0, 0.1, {}).mine == 0  # no feeder named: none of them
    # Scrapes alone cannot tell its lines from others': none is its.
    assert room("m", [ep("a")], {"a": load("a", 4)}, [], 100.0, 0.1, {}, feeder="f-me").mine == 0


def test_the_throttle_counts_its_lines_as_the_reports_did_however_late():
    t = Throttle(most=64)
    # Room for 8; the report was made before any of the 8 lines sent since reached it (held 0,
    # none of them its): they are within its 8, however long ago they were sent.
    assert t.view(Room(free=8, endpoints=1, mine=0), feeders=1, inflight=8) == 8
    assert not t.may_send(8)
    # Counted now (held 8, all its): the same 8. Other traffic takes 2 of the room, or frees it.
    assert t.view(Room(free=0, endpoints=1, mine=8), feeders=1, inflight=8) == 8
    assert t.view(Room(free=-2, endpoints=1, mine=8), feeders=1, inflight=8) == 6
    assert t.view(Room(free=3, endpoints=1, mine=8), feeders=1, inflight=8) == 11
    # Lines the report counted that it no longer waits for (answered since) are not its room.
    assert t.view(Room(free=0, endpoints=1, mine=8), feeders=1, inflight=5) == 5
    assert t.may_send(4) and not t.may_send(5)
    t.shed(4)
    assert not t.may_send(4)


def test_allowance_shares_the_room():
    assert allowance(Room(10, 2), mine=4, feeders=2, most=64) == 9
    assert allowance(Room(-6, 2), mine=4, feeders=2, most=64) == 1
    assert allowance(Room(-20, 2), mine=4, feeders=1, most=64) == 0
    assert allowance(Room(500, 2), mine=0, feeders=1, most=64) == 64


@pytest.mark.parametrize("status_,after,tries,expected", [
    (200, None, 1, Keep(True)),
    (400, None, 1, Keep(False)),
    (404, None, 1, Keep(False)),
    (429, 3.0, 1, Again(3.0, False, "shed")),
    (429, None, 9, Again(1.0, False, "shed")),
    (503, 2.0, 1, Again(2.0, False, "unavailable")),
    (502, None, 1, Again(1.0, True, "HTTP 502")),
    (502, None, 3, Again(4.0, True, "HTTP 502")),
    (502, None, 4, Keep(False)),
    (0, None, 4, GiveUp("no_answer", "no answer after 4 tries: refused")),
])
def test_judge(status_, after, tries, expected):
    assert judge(status_, after, tries, 3, "refused") == expected


def test_step():
    assert step(batch(in_progress_at=1.0), 50.0, 0, 30.0) == Feed()
    assert step(batch(n_completed=6, n_failed=4), 50.0, 0, 30.0) == Seal("completed")
    assert step(batch(cancelling_at=40.0), 50.0, 2, 30.0) == Drain("cancelled")
    assert step(batch(cancelling_at=40.0), 50.0, 0, 30.0) == Seal("cancelled")
    assert step(batch(cancelling_at=10.0), 50.0, 2, 30.0) == Seal("cancelled")  # drained long enough
    assert step(batch(), 100.0, 3, 30.0) == Drain("expired")
    assert step(batch(), 131.0, 3, 30.0) == Seal("expired")
    assert step(batch(sealed_at=5.0, sealed_as="completed"), 50.0, 0, 30.0) == Finish()
    assert step(batch(sealed_at=5.0, completed_at=6.0), 50.0, 0, 30.0) == Nothing()


def test_an_endpoint_of_one_slot_still_takes_a_line_when_it_holds_nothing():
    assert room("m", [ep("a", cap=1)], {}, [report()], 100.0, 0.2, {}).free == 1
    assert room("m", [ep("a", cap=1)], {}, [report(a=1)], 100.0, 0.2, {}).free == 0
