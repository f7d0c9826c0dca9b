"""`llmgw status` and `llmgw node cordon|uncordon|drain` against fakeredis."""

from __future__ import annotations

import json

import fakeredis
import pytest

from llmgw import cli
from llmgw.catalog import apply_catalog
from llmgw.state.node_records import NodeAdmin
from llmgw.state.store import Store
from tests.unit.control_support import catalog, cpu_profile, gpu_profile, model, node
from workers.control.apply import reconcile_once
from workers.control.publish_pass import publish_once


class NullDispatcher:
    def launch(self, replica_id, node):
        pass

    def stop(self, replica_id, node):
        pass


@pytest.fixture
def cli_reads_store(store, monkeypatch):
    """`llmgw node` and `llmgw status` read this test's `store`."""
    monkeypatch.setattr("llmgw.cli.node.store", lambda *_: store)
    monkeypatch.setattr("llmgw.cli.status.store", lambda *_: store)


def test_cordon_drain_uncordon_set_the_admin_flags(store, cli_reads_store, capsys):
    store.write_heartbeat(node("a"), ttl=60)
    assert cli.main(["node", "cordon", "a"]) == 0
    assert store.node_admin("a") == NodeAdmin(cordoned=True, draining=False)
    assert cli.main(["node", "drain", "a"]) == 0
    assert store.node_admin("a") == NodeAdmin(cordoned=True, draining=True)
    assert "draining" in capsys.readouterr().out
    assert cli.main(["node", "uncordon", "a"]) == 0
    assert store.node_admin("a") == NodeAdmin()


def test_unknown_node_is_a_clear_error_with_exit_2(store, cli_reads_store, capsys):
    store.write_heartbeat(node("a"), ttl=60)
    assert cli.main(["node", "cordon", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no node named 'nope' (known nodes: a)" in err and "Traceback" not in err
    assert store.node_admin("nope") == NodeAdmin()  # nothing written


def test_status_reports_nodes_replicas_and_endpoints(store, cli_reads_store, capsys):
    apply_catalog(store, catalog(model("llama", gpu_profile(count=2, replicas=2)), model("tiny", cpu_profile())),
                  source="t", applied_by="t", now=0)
    store.write_heartbeat(node("a", "h100:3"), ttl=60)
    reconcile_once(store, NullDispatcher(), lambda: 100.0)
    (ready,) = [r for r in store.all_replicas() if r.model == "tiny"]
    store.update_replica(ready.id, started_at=100.0, first_ready_at=101.0, last_probe_ok=True, url="http://a:9")
    publish_once(store, lambda: 102.0)
    store.set_node_admin("a", cordoned=True)

    assert cli.main(["status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (a,) = report["nodes"]
    assert a["live"] and a["cordoned"] and not a["draining"]
    assert a["gpus"] == {"h100": {"total": 3, "used": 2, "free": 1}}
    (launching,) = [r for r in store.all_replicas() if r.model == "llama" and r.node]
    ok = {"healthy": True, "health": ""}
    assert a["devices"] == [{"index": 0, "class": "h100", "replica": launching.id, "model": "llama", **ok},
                            {"index": 1, "class": "h100", "replica": launching.id, "model": "llama", **ok},
                            {"index": 2, "class": "h100", "replica": None, "model": None, **ok}]
    states = {r["model"] + "/" + r["state"] for r in report["replicas"]}
    assert states == {"llama/Launching", "llama/Pending", "tiny/Ready"}
    pending = next(r for r in report["replicas"] if r["state"] == "Pending")
    assert pending["reason"] == 'no node in pool "default" has 2 free h100 (free: a 1)'
    assert report["endpoints"] == {"version": 1, "count": 1}

    assert cli.main(["status"]) == 0
    text = capsys.readouterr().out
    assert "h100 2/3 used" in text and "cordoned" in text and "Pending" in text
    assert "ENDPOINTS version 1, 1 routable" in text


def test_status_shows_a_node_that_went_away(store, cli_reads_store, capsys):
    store.write_heartbeat(node("a"), ttl=60)
    store.r.delete("llmgw:node:a:heartbeat")
    assert cli.main(["status", "--json"]) == 0
    (a,) = json.loads(capsys.readouterr().out)["nodes"]
    assert a["name"] == "a" and not a["live"]


@pytest.mark.parametrize("argv", [["status"], ["node", "drain", "a"]])
def test_unreachable_redis_is_one_line_not_a_traceback(monkeypatch, capsys, argv):
    from harness.procs import free_port

    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.delenv("LLMGW_REDIS_URL", raising=False)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("llmgw: cannot reach Redis at redis://127.0.0.1:") and "Traceback" not in err


def test_status_with_a_catalog_this_version_cannot_read_still_reports(store, cli_reads_store, capsys):
    from llmgw.state import keys

    apply_catalog(store, catalog(model("m", cpu_profile())), source="t", applied_by="t", now=0)
    doc = json.loads(store.r.get(keys.CATALOG))
    doc.update(version=9, spec={"models": [{"name": "m", "profiles": [{"name": "p", "engine": "next-engine"}]}]})
    store.r.set(keys.CATALOG, json.dumps(doc))
    store.write_heartbeat(node("a"), ttl=60)
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("catalog version 9 (this llmgw cannot read it:") and "NODES (1)" in out


def test_status_without_a_catalog_says_to_apply_one_and_why_replicas_run(store, cli_reads_store, capsys):
    from llmgw.state.records import ReplicaRecord

    store.write_heartbeat(node("a"), ttl=60)
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no catalog:") and "llmgw catalog apply" in out and "Redis lost" not in out
    # Redis lost its data: the agents registered their running engines again.
    store.create_replica(ReplicaRecord(id="r1", model="m", profile="p", node="a", nodes=["a"]))
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "warning: Redis lost its data? 1 replica(s) run without a catalog" in out
    assert "re-apply the catalog with `llmgw catalog apply FILE`" in out


def test_status_warns_when_a_nodes_clock_runs_ahead(store, cli_reads_store, capsys):
    import dataclasses
    import time

    store.write_heartbeat(dataclasses.replace(node("fast"), heartbeat_at=time.time() + 30), ttl=60)
    store.write_heartbeat(dataclasses.replace(node("ok"), heartbeat_at=time.time()), ttl=60)
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "warning: node fast's clock is" in out and "NTP" in out and "node ok's" not in out


def test_llmgw_up_tells_about_a_crash_loop_once_with_the_log_and_what_to_do():
    from llmgw.catalog import parse_catalog_text
    from llmgw.cli.up import CrashReporter, crash_loop_text
    from llmgw.state.records import ReplicaRecord

    rec = ReplicaRecord(id="r1", model="smollm2", profile="cpu", node="a", exit_code=-4, exit_signal=4,
                        log_tail="loading model\n\nggml: tinygemm_kernel_amx\n")
    text = crash_loop_text(rec, "4 failures in 600s; last exit killed by SIGILL (...)", "llamacpp")
    lines = text.splitlines()
    assert lines[0].startswith("replica r1 (smollm2/cpu) is crash-looping: 4 failures")
    assert "  ggml: tinygemm_kernel_amx" in lines and "  loading model" in lines
    assert "CPU instructions this machine lacks" in lines[-1] and "make clean-engine install" in lines[-1]
    other = crash_loop_text(rec, "why", "sim")
    assert other.endswith("see `llmgw logs r1` and docs/engines.md")

    import fakeredis

    from llmgw.state.store import Store

    store = Store(fakeredis.FakeRedis(decode_responses=True))
    store.write_heartbeat(node("a"), ttl=60)
    now = __import__("time").time()
    crashing = ReplicaRecord(id="r1", model="m", profile="p", node="a", nodes=["a"], attempt=4, started_at=now - 9,
                             exited_at=now - 1, exit_code=1, failure_times=[now - 8, now - 6, now - 4, now - 1])
    store.create_replica(crashing)
    reporter = CrashReporter(parse_catalog_text("models:\n  - name: m\n    profiles:\n      - {name: p, engine: sim}\n"))
    assert len(reporter.check(store)) == 1
    assert reporter.check(store) == []  # once


def test_status_shows_downloads_fit_estimates_and_what_the_engine_reports():
    from llmgw.cli.status import build_status, render
    from llmgw.state.node_records import GPUDevice, NodeInfo
    from llmgw.state.records import ReplicaRecord

    a = NodeInfo("a", gpus=(GPUDevice(0, "l4", healthy=False, health="GPU is lost"), GPUDevice(1, "l4")),
                 weights_dir="/w", weights_free=10, weights_room=10)
    down = ReplicaRecord(id="m-p-1", model="m", profile="p", node="a", nodes=["a"], weights_source="hf://o/r/x.gguf",
                         weights_phase="downloading", weights_done=50 * 1024 ** 2, weights_total=100 * 1024 ** 2)
    ready = ReplicaRecord(id="m-p-2", model="m", profile="p", node="a", nodes=["a"], started_at=1, first_ready_at=2,
                          last_probe_ok=True, engine_memory="model 92.1 MiB, KV cache 180.0 MiB")
    report = build_status({"a": a}, ["a"], {}, [down, ready], 1, 1, 1, 10.0,
                          estimates={("m", "p"): "~0.3 GiB of memory (weights 0.1, KV cache 0.2, overhead 0.0)"})
    row = next(r for r in report["replicas"] if r["id"] == "m-p-1")
    assert row["state"] == "Downloading" and row["download"]["done"] == 50 * 1024 ** 2
    text = render(report)
    assert "50% 50.0 of 100.0 MiB" in text and "GPU 0 unhealthy: GPU is lost" in text
    assert ("m/p: ~0.3 GiB of memory (weights 0.1, KV cache 0.2, overhead 0.0); the engine reports model 92.1 MiB, "
            "KV cache 180.0 MiB") in text
