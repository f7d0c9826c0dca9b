"""The batch feeder's shell (workers/batch/feed.py `Run`) on fakeredis, its views and sends driven by
hand on a fake clock: however late the gateways' reports count its lines, it never has more in flight
than the room its reserve leaves."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.procs import wait_until
from llmgw.batch.config import BatchSettings
from llmgw.state.batch_records import BatchRecord, FileRecord
from llmgw.state.demand_records import EndpointUse, GatewayReport
from llmgw.state.records import EndpointInfo
from workers.batch.client import Answer
from workers.batch.feed import Run

CHAT = "/v1/chat/completions"


class Engine:
    """A line sender whose engine holds every line until its gate is set (as tests/support/fake_upstream.py's)."""

    def __init__(self):
        self.gate = threading.Event()
        self.sent: list[dict] = []

    def __call__(self, path, body, request_id, deadline=None, **headers) -> Answer:
        self.sent.append({"request_id": request_id, **headers})
        self.gate.wait(10)
        return Answer(200, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})


@pytest.fixture
def fed(store):
    """A batch of 50 lines on one endpoint of capacity 10 (reserve 0.2: room for 8), a run of it, and
    its engine."""
    store.write_endpoints([EndpointInfo(id="e1", url="http://e1", models=("m",), engine="sim", model="m",
                                        served_name="m", capacity=10)], "fp", 100.0)
    text = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                               "body": {"model": "m", "messages": []}}) + "\n" for i in range(50))
    store.append_file_chunk("f1", text)
    store.commit_file(FileRecord("f1", "anonymous", "in.jsonl", "batch", len(text), 99.0, requests=50, chunks=1))
    store.create_batch(BatchRecord(id="b1", owner="anonymous", endpoint=CHAT, input_file_id="f1",
                                   completion_window="24h", created_at=99.0, expires_at=99.0 + 86400, total=50,
                                   model="m"))
    engine = Engine()
    settings = BatchSettings.from_env({"LLMGW_BATCH_RESERVE": "0.2"})
    run = Run(store, settings, engine, "b1", "host:1:abcd", lambda bid: None, clock=lambda: 0.0)
    pool = ThreadPoolExecutor(max_workers=64)
    yield store, run, engine, pool
    engine.gate.set()
    pool.shutdown(wait=True)


def report(store, at: float, held: int, **feeders) -> None:
    """The gateway's report at `at`: `held` requests on e1 (`feeders`: whose lines among them)."""
    extra = {"feeders": feeders} if feeders else {}
    store.write_gateway_report(GatewayReport("g:1", at, endpoints={"e1": EndpointUse(held)}, **extra), 60)


def feed(store, run: Run, pool, lines, now: float) -> int:
    b = run._view(now)
    run._dispatch(pool, lines, b, now)
    return len(run.inflight)


def test_a_report_that_lags_the_sends_does_not_open_more_room(fed):
    store, run, engine, pool = fed
    lines = run._unanswered(store.file("f1"))
    report(store, 100.0, 0)
    assert feed(store, run, pool, lines, 100.0) == 8  # the room the reserve leaves: 8 of 10
    # A second later (under load a line may take that long to reach the gateway's count) the
    # gateway's report still holds none of them: its free room is the feeder's own 8, not more.
    report(store, 101.0, 0)
    assert feed(store, run, pool, lines, 101.0) == 8
    report(store, 103.0, 0)
    assert feed(store, run, pool, lines, 103.0) == 8
    assert len(engine.sent) == 8
    # Each line names its run (X-LLMGW-Feeder), by which the gateway's report counts it; counted in
    # part, then in full, it is the same 8.
    wait_until(lambda: len(engine.sent) == 8, 5, what="the 8 lines at the engine")
    assert {s["feeder"] for s in engine.sent} == {run.feeder} and run.feeder.startswith("f-")
    report(store, 104.0, 5, **{run.feeder: 5})
    assert feed(store, run, pool, lines, 104.0) == 8
    report(store, 105.0, 8, **{run.feeder: 8})
    assert feed(store, run, pool, lines, 105.0) == 8
    assert run.throttle.allow == 8
    # Interactive traffic takes 2 of the room: the allowance shrinks (no line is called back).
    report(store, 106.0, 10, **{run.feeder: 8})
    assert feed(store, run, pool, lines, 106.0) == 8 and run.throttle.allow == 6
    # The engine answers them all; the next report holds none: 8 more, no more.
    engine.gate.set()
    while run.inflight:
        run._collect(1.0)
    engine.gate.clear()
    report(store, 107.0, 0)
    assert feed(store, run, pool, lines, 107.0) == 8
    assert store.batch("b1").n_completed == 8 and run.outcome.sent == 16


def test_another_feeders_lines_are_not_its_room(fed):
    store, run, engine, pool = fed
    lines = run._unanswered(store.file("f1"))
    # 5 held, 3 of them another run's (one that died, or another batch's): room for 3 more.
    report(store, 100.0, 5, **{"f-another": 3, run.feeder: 2})
    assert feed(store, run, pool, lines, 100.0) == 3
    # Its own 2 (as the report counted them) are room it holds; once it no longer waits for them
    # (answered since), it counts them as another's until a report says they are gone.
    assert run.throttle.allow == 3
