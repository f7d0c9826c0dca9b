"""`llmgw explain MODEL` and `llmgw events` against fakeredis: the sentences for a Pending replica (why
each node refused it), a crash loop (exit and log lines), a healthy model with the gateways' view; the
events filters and their errors."""

from __future__ import annotations

import json

import pytest

from llmgw import cli
from llmgw.catalog import apply_catalog
from llmgw.state import events, keys
from llmgw.state.demand_records import EndpointUse, GatewayReport, ModelDemand
from llmgw.state.records import LoadRecord
from tests.unit.control_support import catalog, cpu_profile, gpu_profile, model, node
from workers.control.apply import reconcile_once
from workers.control.publish_pass import publish_once

NOW = 10_000.0


class NullDispatcher:
    def launch(self, replica_id, node):
        pass

    def stop(self, replica_id, node):
        pass


@pytest.fixture
def cli_reads_store(store, monkeypatch):
    """`llmgw explain` and `llmgw events` read this test's `store`, at NOW + 30."""
    for mod in ("explain", "events"):
        monkeypatch.setattr(f"llmgw.cli.{mod}.store", lambda *_: store)
    monkeypatch.setattr("llmgw.cli.explain.time.time", lambda: NOW + 30)


def explain(capsys, name: str) -> tuple[int, str]:
    code = cli.main(["explain", name])
    return code, capsys.readouterr().out


def test_a_pending_model_says_why_each_node_refused_it(store, cli_reads_store, capsys):
    apply_catalog(store, catalog(model("big", gpu_profile(cls="h100", count=2))), source="t", applied_by="t")
    store.write_heartbeat(node("cpu1"), ttl=60)
    store.write_heartbeat(node("a10", "a10g:2"), ttl=60)
    store.write_heartbeat(node("gone", "h100:8"), ttl=60)
    store.r.hset(keys.NODES_LAST_SEEN, "gone", repr(NOW - 90))
    store.r.delete(keys.node_heartbeat("gone"))
    reconcile_once(store, NullDispatcher(), lambda: NOW)
    code, out = explain(capsys, "big")
    assert code == 1
    (rid,) = [r.id for r in store.all_replicas()]
    assert "big: 0 of 1 replicas asked for are Ready; what is missing and why:" in out
    assert f'{rid} is Pending for 30s: no node in pool "default" has h100 GPUs (it has: a10g)' in out
    assert "  - a10: has no h100 GPUs (it has a10g)" in out
    assert "  - cpu1: has no h100 GPUs (it has no GPUs)" in out
    assert "Not considered (no heartbeat): gone (last seen 2m ago)." in out
    assert "No endpoint of big is published" in out


def test_a_crash_loop_shows_the_exit_and_the_last_log_lines(store, cli_reads_store, capsys):
    apply_catalog(store, catalog(model("chat", cpu_profile())), source="t", applied_by="t")
    store.write_heartbeat(node("a"), ttl=60)
    reconcile_once(store, NullDispatcher(), lambda: NOW)
    (rec,) = store.all_replicas()
    log = "\n".join(f"line {i}" for i in range(30)) + "\nfatal: model file is truncated\n"
    store.update_replica(rec.id, started_at=NOW - 5, exited_at=NOW, exit_code=-9, exit_signal=9, attempt=5,
                         failure_times=[NOW - 100, NOW - 60, NOW - 30, NOW], next_restart_at=NOW + 50, log_tail=log)
    code, out = explain(capsys, "chat")
    assert code == 1
    assert f"{rec.id} is in a crash loop on a: 4 unexpected exits in the last 600s; attempt 5 killed by SIGKILL (often out of memory" in out
    assert "Next start in 20s." in out
    assert f"The last lines of its log (llmgw logs {rec.id}):" in out
    assert "    | fatal: model file is truncated" in out and "    | line 21" in out and "line 20\n" not in out


def test_a_crash_loop_between_two_crashes_is_still_told_as_one(store, cli_reads_store, capsys):
    """After its backoff the agent starts the engine again: the replica is Starting for a moment, and
    `explain` still says it is crash-looping, with the last exit (the e2e test once caught it there)."""
    apply_catalog(store, catalog(model("chat", cpu_profile())), source="t", applied_by="t")
    store.write_heartbeat(node("a"), ttl=60)
    reconcile_once(store, NullDispatcher(), lambda: NOW)
    (rec,) = store.all_replicas()
    store.update_replica(rec.id, exited_at=NOW - 10, exit_code=1, started_at=NOW + 28, attempt=6,
                         failure_times=[NOW - 100, NOW - 60, NOW - 30, NOW - 10], next_restart_at=NOW + 28)
    code, out = explain(capsys, "chat")
    assert code == 1
    assert (f"{rec.id} is in a crash loop on a: 4 unexpected exits in the last 600s; the last exit: exited with "
            "code 1; attempt 6 started 2.0s ago, not healthy yet.") in out
    assert "Next start" not in out  # the attempt that runs is that start


def test_a_healthy_model_exits_0_and_tells_the_gateways_view(store, cli_reads_store, capsys):
    apply_catalog(store, catalog(model("chat", cpu_profile(), aliases=["c"])), source="t", applied_by="t")
    store.write_heartbeat(node("a"), ttl=60)
    reconcile_once(store, NullDispatcher(), lambda: NOW)
    (rec,) = store.all_replicas()
    store.update_replica(rec.id, started_at=NOW, first_ready_at=NOW, last_probe_ok=True, url="http://a:1")
    publish_once(store, lambda: NOW)
    store.write_load(LoadRecord(rec.id, ts=NOW, ok=True, running=3, waiting=7, kv_usage=0.91))
    store.write_gateway_report(GatewayReport("g:1", at=NOW, endpoints={rec.id: EndpointUse(4)},
                                             models={"chat": ModelDemand(4, 2, NOW)}), ttl=60)
    store.emit("model_saturated", "every endpoint saturated: 1 queued, 0 shed", source="gateway:g:1",
                model="chat", ts=NOW + 10)
    code, out = explain(capsys, "c")  # an alias names the model too
    assert code == 0
    assert out.startswith("chat: 1 of 1 replicas asked for are Ready.")
    assert f"- {rec.id} on a: 4 in flight from the gateways; engine 3 running, 7 waiting, KV 91%" in out
    assert "1 gateway process(es) report 4 request(s) in flight and 2 queued for chat." in out
    assert "every endpoint is saturated" in out
    assert "20s ago gateway:g:1 reported it saturated: every endpoint saturated: 1 queued, 0 shed." in out


def test_explain_shows_the_prefix_cache_expected_by_the_gateways_and_measured_by_the_engine(store, cli_reads_store, capsys):
    apply_catalog(store, catalog(model("chat", cpu_profile())), source="t", applied_by="t")
    store.write_heartbeat(node("a"), ttl=60)
    reconcile_once(store, NullDispatcher(), lambda: NOW)
    (rec,) = store.all_replicas()
    store.update_replica(rec.id, started_at=NOW, first_ready_at=NOW, last_probe_ok=True, url="http://a:1")
    publish_once(store, lambda: NOW)
    # two gateway processes: 3000 + 1000 prompt tokens sent, 2000 + 600 of them expected cached
    for g, tally in (("g:1", (3000.0, 2000.0, 0.0, 0.0)), ("g:2", (1000.0, 600.0, 800.0, 500.0))):
        store.write_gateway_report(GatewayReport(g, at=NOW, endpoints={rec.id: EndpointUse(0, NOW, None, tally)}),
                                   ttl=60)
    code, out = explain(capsys, "chat")
    assert "prefix cache: the gateways expected 65% of the 4,000 prompt tokens they sent it cached; " \
           "the engine reports 62% reused (its answers)" in out
    # the engine's own counters (vLLM's, scraped) win over the answers' count
    store.write_load(LoadRecord(rec.id, ts=NOW, ok=True, running=0, waiting=0, prefix_queries_total=1000.0,
                                prefix_hits_total=700.0))
    code, out = explain(capsys, "chat")
    assert "the engine reports 70% reused (its prefix-cache counters)" in out
    assert "indexed up to 32,768 tokens (the default)" in out
    store.write_load(LoadRecord(rec.id, ts=NOW, ok=True, running=0, waiting=0, prefix_queries_total=1000.0,
                                prefix_hits_total=700.0, kv_tokens=432544))
    code, out = explain(capsys, "chat")
    assert "indexed up to 432,544 tokens (the engine's)" in out  # what the gateways size it to, and why


def test_an_unknown_model_names_the_ones_there_are(store, cli_reads_store, capsys):
    apply_catalog(store, catalog(model("chat", cpu_profile())), source="t", applied_by="t")
    code, out = explain(capsys, "nope")
    assert code == 1 and "nope is not a model or alias of the applied catalog (models: chat)." in out


# --- llmgw events ---------------------------------------------------------------------------------------
def test_events_filters_and_prints_json_lines_in_order(store, cli_reads_store, capsys):
    for i, (kind, m, n) in enumerate([("replica_placed", "chat", "a"), ("node_cordoned", "", "b"),
                                      ("replica_failed", "chat", "a"), ("replica_ready", "big", "b")]):
        store.emit(kind, f"m{i}", model=m, node=n, ts=NOW + i)
    assert cli.main(["events", "--json", "--kind", "replica_*", "--model", "chat"]) == 0
    got = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(e["kind"], e["message"]) for e in got] == [("replica_placed", "m0"), ("replica_failed", "m2")]
    assert cli.main(["events", "--node", "b", "-n", "1"]) == 0
    (text,) = capsys.readouterr().out.splitlines()
    assert "replica_ready" in text and "big on b: m3" in text


def test_events_since_reads_every_event_of_the_while(store, cli_reads_store, capsys, monkeypatch):
    monkeypatch.setattr("llmgw.cli.events.time.time", lambda: NOW + 100)
    for i in range(30):
        store.emit("replica_ready", f"m{i}", ts=NOW + i * 3)  # the last one at NOW + 87
    assert cli.main(["events", "--since", "30s", "--json"]) == 0  # from NOW + 70: m24 .. m29
    assert [json.loads(ln)["message"] for ln in capsys.readouterr().out.splitlines()] == [f"m{i}" for i in range(24, 30)]


@pytest.mark.parametrize("argv,message", [
    (["--since", "soon"], "llmgw: --since: expected a duration like 30s, 10m, 2h or 1d, got 'soon'"),
    (["--kind", "replica_exploded"], "llmgw: --kind: no event kind 'replica_exploded'; kinds: catalog_applied,"),
    (["-n", "0"], "llmgw: -n: must be at least 1, got 0"),
])
def test_events_bad_arguments_are_one_clear_line(store, cli_reads_store, capsys, argv, message):
    assert cli.main(["events", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err


def test_a_download_is_told_with_its_figures_its_failure_and_the_fit_estimate(store, cli_reads_store, capsys):
    from llmgw.state.weights import WeightsFacts

    hf = "hf://org/smol-gguf/*Q4_1.gguf"
    shape = dict(weights_bytes=96_576_768, layers=30, heads=9, kv_heads=3, head_dim=64, kv_elems_per_token=11_520,
                 hidden=576, ff=1536, vocab=49_152, context_length=8192)
    cat = catalog(model("smol", {"name": "cpu", "engine": "llamacpp"}) | {"source": hf})
    apply_catalog(store, cat, source="t", applied_by="t")
    store.write_heartbeat(node("a"), ttl=60)
    store.write_weights_facts(WeightsFacts(hf, "llamacpp", size=100_000_000, shape=shape))
    reconcile_once(store, NullDispatcher(), lambda: NOW)
    (rec,) = store.all_replicas()
    store.update_replica(rec.id, weights_source=hf, weights_phase="downloading", weights_done=50 * 1024 ** 2,
                         weights_total=100 * 1024 ** 2, weights_rate=10 * 1024 ** 2, weights_eta=5.0)
    code, out = explain(capsys, "smol")
    assert code == 1
    assert (f"{rec.id} is Downloading on a {hf}: 50% 50.0 of 100.0 MiB, 10.0 MiB/s, ETA 5s. Its engine starts once "
            "the weights are local; its start timeout counts from then.") in out
    assert "Fit estimate from its weights' headers: ~0.3 GiB of memory (weights 0.1, KV cache 0.2" in out
    store.update_replica(rec.id, weights_phase="failed", weights_error_kind="auth", failure_times=[NOW],
                         weights_error="the hub refused the token (HF_TOKEN) for org/smol-gguf", next_restart_at=NOW + 70)
    code, out = explain(capsys, "smol")
    assert (f"{rec.id} Failed on a: the download of {hf} failed (auth): the hub refused the token (HF_TOKEN) for "
            "org/smol-gguf. Next try in 40s.") in out
