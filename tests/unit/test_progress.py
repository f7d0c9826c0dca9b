"""The progress lines of `llmgw up` and `llmgw catalog apply --wait`: rows from `llmgw status`'s report,
redrawn in place on a terminal, one line per change when piped."""

from __future__ import annotations

import dataclasses
import io

from llmgw.cli.progress import Progress, Row, changes, frame, lines, rows
from llmgw.cli.status import build_status
from llmgw.state.records import ReplicaRecord
from tests.unit.control_support import node

NOW = 1_000.0


def report_of(*recs: ReplicaRecord, listed=()) -> tuple[dict, dict]:
    live = {"a": node("a")}
    return build_status(live, ["a"], {}, recs, 3, len(listed), 1, NOW, listed=set(listed)), {r.id: r for r in recs}


def rec(rid: str, **kw) -> ReplicaRecord:
    return ReplicaRecord(id=rid, model="m", profile="cpu", created_at=NOW - 20, **kw)


PENDING = rec("m-cpu-01", pending_reason="no node with a free GPU")
LAUNCHING = rec("m-cpu-02", node="a", nodes=["a"], launch_dispatched_at=NOW - 3)
STARTING = rec("m-cpu-03", node="a", nodes=["a"], launch_dispatched_at=NOW - 15, started_at=NOW - 12, attempt=1,
               pid=10, engine_pid=11)
PROBING = rec("m-cpu-04", node="a", nodes=["a"], started_at=NOW - 5, attempt=1, pid=10, probe_error="HTTP 503")
READY = rec("m-cpu-05", node="a", nodes=["a"], started_at=NOW - 9, first_ready_at=NOW - 2, last_probe_ok=True,
            attempt=1, pid=10)
FAILED = rec("m-cpu-06", node="a", nodes=["a"], started_at=NOW - 9, exited_at=NOW - 1, exit_code=1, attempt=1,
             failure_times=[NOW - 1])
LOOPING = rec("m-cpu-07", node="a", nodes=["a"], started_at=NOW - 1, attempt=5, pid=10,
              failure_times=[NOW - 40, NOW - 30, NOW - 20, NOW - 5], exit_code=1)


def test_each_replica_gets_its_state_time_in_it_and_what_it_waits_for():
    report, records = report_of(PENDING, LAUNCHING, STARTING, PROBING, READY, FAILED, LOOPING, listed=[READY.id])
    got = {r.replica: r for r in rows(report, records, NOW)}
    assert got[PENDING.id].status() == "Pending for 20s: no node with a free GPU"
    assert got[LAUNCHING.id].status() == "Launching for 3.0s: waiting for the node agent of a to start it"
    assert got[STARTING.id].status() == "Starting for 12s: waiting for its health check"
    assert got[PROBING.id].status() == "Starting for 5.0s: waiting for its health check (last probe: HTTP 503)"
    assert got[READY.id].status() == "Ready for 2.0s"
    assert got[FAILED.id].status() == "Failed for 1.0s: exited with code 1; restarting after a backoff"
    assert got[LOOPING.id].status() == ("Starting for 1.0s: crash loop (4 exits in 600s), started again; "
                                        "waiting for its health check")
    assert got[PENDING.id].label == "m/cpu m-cpu-01"


def test_a_ready_replica_not_yet_routed_waits_for_the_endpoint_list():
    report, records = report_of(READY)
    (row,) = rows(report, records, NOW)
    assert row.status() == "Ready for 2.0s: waiting for the gateways' endpoint list to include it"


def test_rows_keep_the_reports_order_and_only_the_models_asked_for():
    other = ReplicaRecord(id="o-cpu-01", model="o", profile="cpu", created_at=NOW - 1)
    report, records = report_of(READY, other, PENDING)
    assert [r.replica for r in rows(report, records, NOW)] == [PENDING.id, READY.id, other.id]
    assert [r.replica for r in rows(report, records, NOW, models=["o"])] == [other.id]


A = Row("m", "cpu", "m-cpu-01", "Starting", 2.0, "waiting for its health check")
B = Row("model-with-a-long-name", "gpu", "x-01", "Pending", 1.0, "no node with a free GPU")


def test_lines_align_the_labels():
    assert lines([A, B]) == [
        "m/cpu m-cpu-01                   Starting for 2.0s: waiting for its health check",
        "model-with-a-long-name/gpu x-01  Pending for 1.0s: no node with a free GPU",
    ]


def test_a_terminal_frame_redraws_the_lines_it_drew_last_time():
    first, drawn = frame([A, B], 0, 200)
    assert drawn == 2
    assert first == "\x1b[J" + "".join(f"{line}\n" for line in lines([A, B]))
    later = Row("m", "cpu", "m-cpu-01", "Ready", 0.5, "")
    second, drawn = frame([later, B], drawn, 200)
    assert second.startswith("\r\x1b[2A\x1b[J")  # up over the two lines, erase them and below
    assert second.endswith("Ready for 0.5s\n" + lines([later, B])[1] + "\n")
    assert drawn == 2


def test_a_terminal_frame_prints_messages_above_the_lines_once_and_cuts_lines_to_the_width():
    text, drawn = frame([A, B], 2, 40, above=["llmgw up: replica x is crash-looping"])
    assert drawn == 2  # the message stays; only the rows are redrawn next time
    body = text.split("\x1b[J", 1)[1].splitlines()
    assert body[0] == "llmgw up: replica x is crash-looping"
    assert all(len(line) <= 39 for line in body[1:]) and body[1].endswith("...")


def test_piped_output_prints_a_line_only_when_a_state_or_its_reason_changes():
    printed, seen = changes([A, B], {})
    assert printed == ["m/cpu m-cpu-01  Starting for 2.0s: waiting for its health check",
                       "model-with-a-long-name/gpu x-01  Pending for 1.0s: no node with a free GPU"]
    later = [Row("m", "cpu", "m-cpu-01", "Starting", 9.0, A.waiting), Row(*B.__dict__.values())]
    assert changes(later, seen)[0] == []  # only time passed
    probe = Row("m", "cpu", "m-cpu-01", "Starting", 9.5, "waiting for its health check (last probe: HTTP 503)")
    printed, seen = changes([probe, B], seen)
    assert printed == ["m/cpu m-cpu-01  Starting for 9.5s: waiting for its health check (last probe: HTTP 503)"]
    ready = Row("m", "cpu", "m-cpu-01", "Ready", 0.1, "")
    assert changes([ready, B], seen)[0] == ["m/cpu m-cpu-01  Ready for 0.1s"]


def test_progress_writes_plain_lines_to_a_pipe_and_redraws_on_a_terminal():
    pipe = io.StringIO()
    p = Progress(pipe, prefix="llmgw up: ")
    assert not p.tty  # a StringIO is no terminal
    for t in (1.0, 1.5, 2.0):
        p.show([Row("m", "cpu", "m-cpu-01", "Starting", t, A.waiting)])
    p.say("something happened")
    p.show([Row("m", "cpu", "m-cpu-01", "Ready", 0.1, "")])
    assert pipe.getvalue().splitlines() == [
        "llmgw up: m/cpu m-cpu-01  Starting for 1.0s: waiting for its health check",
        "llmgw up: something happened",
        "llmgw up: m/cpu m-cpu-01  Ready for 0.1s",
    ]
    assert "\x1b" not in pipe.getvalue()

    term = io.StringIO()
    p = Progress(term, prefix="llmgw up: ", tty=True)
    p.show([A])
    p.show([A])
    p.say("something happened")
    out = term.getvalue()
    assert out.count("\r\x1b[1A\x1b[J") == 2 and out.count(lines([A])[0]) == 3
    assert "llmgw up: something happened\n" + lines([A])[0] in out


def test_a_download_shows_its_figures_on_a_terminal_and_tens_of_percent_when_piped():
    hf = "hf://org/smol-gguf/*Q4_1.gguf"
    d = rec("m-cpu-08", node="a", nodes=["a"], weights_source=hf, weights_phase="downloading",
            weights_started_at=NOW - 9, weights_done=3_435_973_837, weights_total=8_375_186_227,
            weights_rate=115_343_360.0, weights_eta=42.4)
    report, records = report_of(d)
    (row,) = rows(report, records, NOW)
    assert row.status() == f"Downloading for 9.0s: downloading {hf} 40%"
    assert row.status(detail=True) == (f"Downloading for 9.0s: downloading {hf} 40% "
                                       "(41% 3.2 of 7.8 GiB, 110.0 MiB/s, ETA 42s)")
    assert lines([row], detail=True)[0].endswith("ETA 42s)")
    faster = dataclasses.replace(d, weights_done=3_500_000_000, weights_eta=40.0)
    printed, seen = changes([row], {})
    again, _ = changes(rows(*report_of(faster), NOW), seen)
    assert len(printed) == 1 and again == []  # the bytes moved, the step did not: no new line
