"""`llmgw models pull|ls`: what is pulled where, how a pull reads, each node's cache."""

from __future__ import annotations

import fakeredis
import pytest

from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.cli import main
from llmgw.cli.models import Target, cache_report, pull_line, render, targets
from llmgw.gpus import parse_gpu_spec
from llmgw.state.node_records import CachedWeights, NodeInfo
from llmgw.state.weights import PullStatus
from llmgw.state.store import Store

HF = "hf://org/smol-gguf/*Q4_1.gguf"
CAT = parse_catalog({"models": [
    {"name": "smol", "source": HF, "profiles": [
        {"name": "cpu", "engine": "llamacpp"},
        {"name": "gpu", "engine": "llamacpp", "gpu": {"class": "l4"}, "pool": "gpu"}]},
    {"name": "local", "source": "/m/x.gguf", "profiles": [{"name": "cpu", "engine": "llamacpp"}]}]})
NODES = {"a": NodeInfo("a"), "b": NodeInfo("b", pool="gpu", gpus=parse_gpu_spec("l4:1")),
         "c": NodeInfo("c", pool="gpu")}


def test_targets_are_the_nodes_each_profile_may_be_placed_on():
    got, problem = targets(CAT, "smol", None, NODES, None)
    assert problem is None and got == [Target("a", HF, "llamacpp"), Target("b", HF, "llamacpp")]  # c has no l4
    assert targets(CAT, "smol", "gpu", NODES, None)[0] == [Target("b", HF, "llamacpp")]
    assert targets(CAT, "smol", None, NODES, "c")[0] == [Target("c", HF, "llamacpp")]


@pytest.mark.parametrize("args,problem", [
    (("nope", None, None), "nope is not a model or alias of the applied catalog (models: smol, local)"),
    (("smol", "tpu", None), "model smol has no profile 'tpu' (profiles: cpu, gpu)"),
    (("smol", None, "z"), "node 'z' sends no heartbeat (live nodes: a, b, c)"),
    (("local", None, None), "local has no hf:// or https:// source to pull (/m/x.gguf): a local path or pkg: is "
                            "on the node already"),
])
def test_nothing_to_pull_says_why(args, problem):
    assert targets(CAT, *args[:2], NODES, args[2]) == ([], problem)


def test_pull_lines():
    t = Target("a", HF, "llamacpp")
    assert pull_line(t, None) == f"a  {HF}  asked; waiting for its node agent"
    st = PullStatus(HF, "downloading", 3 * 1024 ** 3, 8 * 1024 ** 3, rate=110 * 1024 ** 2, eta=42)
    assert pull_line(t, st) == f"a  {HF}  downloading 38% 3.0 GiB of 8.0 GiB, 110.0 MiB/s, ETA 42s"
    assert pull_line(t, PullStatus(HF, "failed", error="the hub refused the token", error_kind="auth")) == \
        f"a  {HF}  failed (auth): the hub refused the token"


def test_ls_shows_each_nodes_cache(capsys, monkeypatch):
    nodes = {"a": NodeInfo("a", weights=(CachedWeights(HF, 100 * 1024 ** 2, 900.0),), weights_dir="/w",
                           weights_free=10 * 1024 ** 3, weights_room=12 * 1024 ** 3, weights_budget=20 * 1024 ** 3)}
    text = render(cache_report(nodes, 1000.0))
    assert f"a     {HF}  100.0 MiB  100s ago" in text
    assert "a: 10.0 GiB free under /w, room for 12.0 GiB, budget 20.0 GiB" in text


def test_pull_asks_the_nodes(monkeypatch, capsys):
    s = Store(fakeredis.FakeRedis(decode_responses=True))
    apply_catalog(s, CAT, source="t", applied_by="t")
    for info in NODES.values():
        s.write_heartbeat(info, 60)
    monkeypatch.setattr("llmgw.cli.models.store", lambda cfg=None: s)
    assert main(["models", "pull", "smol", "--no-wait"]) == 0
    assert s.pull_requests("a") == {HF: "llamacpp"} and s.pull_requests("b") == {HF: "llamacpp"}
    assert main(["models", "pull", "local"]) == 2
    assert "no hf:// or https:// source" in capsys.readouterr().err
