"""Where each LoRA adapter lives, as `llmgw status`, the console's models page and `llmgw explain ADAPTER`
show it (llmgw/cli/adapterview.py over the reconcile pass's rows and the replica records): holders,
loads in progress, replicas told to hold it, failed loads with reason and next try, why it is short,
its demand; through the real CLI on fakeredis."""

from __future__ import annotations

import pytest

from gateway.ui.views import models_view
from llmgw import cli
from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.cli.adapterview import adapter_rows
from llmgw.cli.status import build_status, render
from llmgw.state.node_records import NodeInfo
from llmgw.state.records import ReplicaRecord

NOW = 5000.0
CATALOG = parse_catalog({"models": [
    {"name": "m", "profiles": [{"name": "p", "engine": "sim", "replicas": 2, "lora": {"max_loras": 2}}],
     "adapters": [{"name": "a1", "aliases": ["x1"], "source": "/ad/a1", "rank": 8},
                  {"name": "a2", "source": "/ad/a2", "rank": 8, "replicas": 2}]}]})
PLACED = [{"adapter": "a2", "model": "m", "wanted": 2, "placed": 1, "reason": "every replica that serves it is full",
           "demand": 0.0},
          {"adapter": "a1", "model": "m", "wanted": 1, "placed": 1, "reason": "", "demand": 3.0}]


def replicas() -> list[ReplicaRecord]:
    r1 = ReplicaRecord(id="r1", model="m", profile="p", node="n1", attempt=1, adapters_wanted=["a1", "a2"],
                       adapters_held=["a1"], adapters_loading=["a2"], adapters_attempt=1)
    r2 = ReplicaRecord(id="r2", model="m", profile="p", node="n2", attempt=1, adapters_wanted=["a2"],
                       adapters_attempt=1, adapter_failures={"a2": {"reason": "vLLM found no adapter at '/ad/a2'",
                                                                    "at": NOW - 3, "attempts": 2,
                                                                    "retry_at": NOW + 7}})
    return [r1, r2]


def test_rows_join_the_placement_with_the_records():
    a1, a2 = adapter_rows(PLACED, replicas(), NOW)
    assert (a1["adapter"], a1["holders"], a1["demand"], a1["short"]) == ("a1", [{"replica": "r1", "node": "n1"}], 3.0, "")
    assert (a2["loading"], a2["waiting"], a2["holders"]) == (["r1"], ["r2"], [])
    assert a2["failures"] == [{"replica": "r2", "reason": "vLLM found no adapter at '/ad/a2'", "attempts": 2,
                               "age": 3.0, "retry_in": 7.0}]
    report = build_status({"n1": NodeInfo("n1"), "n2": NodeInfo("n2")}, ["n1", "n2"], {}, replicas(), 1, 0, 1, NOW,
                          adapters=PLACED)
    text = render(report)
    assert "ADAPTERS (2)" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("a2 "))
    assert "loading on r1; to load on r2; failed on r2 (2x, next try in 7s): vLLM found no adapter" in line
    assert "short: every replica that serves it is full" in line
    models = models_view(CATALOG, report, [], {}, {}, {}, {}, 1.0, NOW)["models"]
    assert [a["adapter"] for a in models[0]["adapters"]] == ["a1", "a2"]


@pytest.fixture
def fleet(store, monkeypatch):
    """`store` holds CATALOG and its replicas, and `llmgw explain` and `llmgw status` read it, at NOW."""
    for mod in ("explain", "status"):
        monkeypatch.setattr(f"llmgw.cli.{mod}.store", lambda *_: store)
    monkeypatch.setattr("llmgw.cli.explain.time.time", lambda: NOW)
    apply_catalog(store, CATALOG, source="t", applied_by="t", now=0)
    for r in replicas():
        store.create_replica(r)


def test_explain_an_adapter_by_its_alias(store, fleet, capsys):
    store.write_adapter_rows(PLACED, NOW)
    code = cli.main(["explain", "x1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0] == ("Adapter a1 of model m: wanted on 1 replica(s) at least, held by 1, requests in "
                                   "flight or queued: 3.")
    assert "r1 on n1 holds it: requests for a1 are routed there." in out
    code = cli.main(["explain", "a2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "r1 is loading it now." in out
    assert "r2 is told to hold it and does not yet" in out
    assert "Loading it on r2 failed 2 time(s), the last 3s ago: vLLM found no adapter at '/ad/a2'. Next try in 7s." in out
    assert "It is on fewer replicas than wanted: every replica that serves it is full." in out
    assert "No replica holds it: a request for a2 waits for one to load it" in out


def test_explain_an_adapter_not_placed_yet(store, fleet, capsys):
    assert cli.main(["explain", "a1"]) == 1
    assert "the control plane has not placed it yet" in capsys.readouterr().out
