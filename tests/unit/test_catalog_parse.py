"""Valid catalogs: defaults and their precedence, GPU normalisation, resolution, hashes."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.catalog import (
    ENGINE_DEFAULTS,
    Catalog,
    GPURequest,
    MetricMapping,
    Model,
    Profile,
    load_catalog_file,
    parse_catalog,
    parse_catalog_text,
    profile_spec_hash,
)
from llmgw.engines import ENGINES
from llmgw.engines.base import LaunchContext

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "catalog.yaml"


def test_example_catalog_is_valid_and_is_the_mixed_fleet_it_says():
    cat = load_catalog_file(EXAMPLE)
    qwen = cat.resolve("qwen")
    assert qwen is not None and qwen.name == "qwen2.5-7b-instruct"
    engines = {p.engine: p for p in qwen.profiles}
    assert engines["vllm"].priority == 10 and engines["vllm"].gpu is not None
    assert engines["llamacpp"].gpu is None and engines["llamacpp"].priority < 10
    assert qwen.source_for(engines["llamacpp"]).endswith(".gguf")
    assert any(p.engine == "sim" for _, p in cat.profiles())


def test_engine_defaults_fill_what_a_profile_omits():
    cat = parse_catalog({"models": [
        {"name": "a", "source": "org/a", "profiles": [{"name": "g", "engine": "vllm", "gpu": {"class": "h100"}}]},
        {"name": "b", "source": "/b.gguf", "profiles": [{"name": "c", "engine": "llamacpp"}]},
        {"name": "c", "profiles": [{"name": "s", "engine": "sim"}]},
        {"name": "d", "profiles": [{"name": "x", "engine": "external", "url": "http://10.0.0.1:8000"}]},
    ]})
    got = {p.engine: (p.start_timeout, p.capacity) for _, p in cat.profiles()}
    assert got == {"vllm": (900.0, 64), "llamacpp": (120.0, 4), "sim": (60.0, 16), "external": (120.0, 32)}
    for engine, d in ENGINE_DEFAULTS.items():
        assert got[engine][1] == d["capacity"] and d.get("start_timeout", 120.0) == got[engine][0]
    assert cat.model("d").profiles[0].replicas == 0  # llmgw runs no replica of an external server
    p = cat.model("c").profiles[0]
    assert (p.replicas, p.tensor_parallel, p.pipeline_parallel, p.nodes, p.priority, p.weight, p.pool) == (
        1, 1, 1, 1, 0, 1.0, "default")


def test_precedence_profile_over_defaults_over_engine():
    cat = parse_catalog_text("""
defaults:
  start_timeout: 300
  replicas: 3
  env: {A: "1", B: "1"}
  node_selector: {zone: a}
models:
  - name: m
    profiles:
      - {name: s, engine: sim, replicas: 5, env: {B: "2", C: "3"}}
      - {name: t, engine: sim, start_timeout: 10, node_selector: {disk: ssd}}
""")
    s, t = cat.model("m").profiles
    assert (s.replicas, s.start_timeout, s.capacity) == (5, 300.0, 16)
    assert s.env == {"A": "1", "B": "2", "C": "3"}  # maps merge key by key, the profile wins
    assert (t.replicas, t.start_timeout) == (3, 10.0)
    assert t.node_selector == {"zone": "a", "disk": "ssd"}


def test_defaults_gpu_merges_and_an_explicit_null_means_cpu():
    cat = parse_catalog_text("""
defaults: {engine: vllm, gpu: {class: a100}}
models:
  - name: m
    source: org/m
    profiles:
      - {name: tp4, tensor_parallel: 4}
      - {name: two-nodes, tensor_parallel: 4, pipeline_parallel: 2, nodes: 2}
  - name: n
    source: /n.gguf
    profiles:
      - {name: cpu, engine: llamacpp, gpu: null}
""")
    tp4, multi = cat.model("m").profiles
    assert tp4.gpu == GPURequest(gpu_class="a100", count=4)  # count defaults to tp x pp / nodes
    assert multi.gpu.count == 4 and multi.gpus_per_replica == 8
    assert cat.model("n").profiles[0].gpu is None


def test_gpu_class_is_normalised_with_the_shared_normaliser():
    cat = parse_catalog_text("""
models:
  - name: m
    source: org/m
    profiles: [{name: g, engine: vllm, gpu: {class: "NVIDIA H100 80GB HBM3"}}]
""")
    assert cat.model("m").profiles[0].gpu.gpu_class == "h100"


def test_metric_mappings_follow_the_seed_rule():
    cat = parse_catalog_text("""
models:
  - name: m
    profiles:
      - {name: empty, engine: sim}
      - {name: own, engine: sim, metrics: {running: my_running}}
      - {name: partial, engine: sim, metrics: {waiting: my_waiting}}
""")
    empty, own, partial = cat.model("m").profiles
    sim = ENGINES["sim"]
    assert sim.effective_metrics(empty) == sim.default_metrics
    assert sim.effective_metrics(own) == MetricMapping(running="my_running")  # complete: blanks stay blank
    assert sim.effective_metrics(partial).waiting == "my_waiting"


def test_resolve_by_name_and_alias():
    cat = parse_catalog_text("models:\n  - {name: m, aliases: [x, y], profiles: [{name: s, engine: sim}]}\n")
    assert cat.resolve("m") is cat.resolve("x") is cat.resolve("y") is cat.model("m")
    assert cat.resolve("z") is None and cat.model("x") is None
    assert cat.model("m").names == ["m", "x", "y"]
    assert cat.model("m").profile("s").engine == "sim" and cat.model("m").profile("nope") is None


def test_empty_catalog_is_valid():
    assert parse_catalog_text("models: []\n").models == []
    assert parse_catalog_text("").models == []


def test_canonical_round_trips_and_hash_ignores_formatting():
    a = parse_catalog_text("models:\n  - {name: m, profiles: [{name: s, engine: sim, replicas: 2}]}\n")
    b = parse_catalog_text("""
# same content, other layout, defaults spelled out
models:
  - name: m
    aliases: []
    profiles:
      - engine: sim
        name: s
        replicas: 2
        capacity: 16
""")
    assert a.hash() == b.hash()
    again = Catalog.model_validate(a.canonical())
    assert again == a and again.hash() == a.hash()
    assert parse_catalog(a.canonical()).hash() == a.hash()  # a resolved spec validates as-is
    c = parse_catalog_text("models:\n  - {name: m, profiles: [{name: s, engine: sim, replicas: 3}]}\n")
    assert c.hash() != a.hash()


def test_spec_hash_ignores_live_fields_only():
    m = Model(name="m", profiles=[Profile(name="s", engine="sim")])
    p = m.profiles[0]
    base = profile_spec_hash(m, p)
    for live in ({"replicas": 7}, {"priority": 3}, {"weight": 2.0}):
        assert profile_spec_hash(m, p.model_copy(update=live)) == base
    assert profile_spec_hash(m, p.model_copy(update={"args": ["--x"]})) != base
    assert profile_spec_hash(m.model_copy(update={"source": "other"}), p) != base


def test_profile_source_overrides_the_model_source_in_the_launch_context():
    cat = load_catalog_file(EXAMPLE)
    qwen = cat.model("qwen2.5-7b-instruct")
    cpu = next(p for p in qwen.profiles if p.engine == "llamacpp")
    gpu = next(p for p in qwen.profiles if p.engine == "vllm")
    ctx = LaunchContext(replica_id="r", model=qwen, profile=cpu, host="127.0.0.1", port=1)
    assert ctx.model.source == cpu.source and ctx.model.name == qwen.name
    ctx = LaunchContext(replica_id="r", model=qwen, profile=gpu, host="127.0.0.1", port=1)
    assert ctx.model.source == "Qwen/Qwen2.5-7B-Instruct"


def test_direct_construction_still_gets_engine_defaults():
    assert Profile(name="g", engine="vllm", gpu=GPURequest(gpu_class="h100")).start_timeout == 900.0
    assert Profile(name="s", engine="sim").capacity == 16


@pytest.mark.parametrize("text", ["models:\n  - {name: m, profiles: [{name: s, engine: sim, capacity: null}]}\n"])
def test_null_capacity_means_the_engine_default(text):
    assert parse_catalog_text(text).model("m").profiles[0].capacity == 16


def test_docs_describe_every_field_and_engine_default():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "catalog.md").read_text()
    for field in [*Profile.model_fields, "aliases", "defaults"]:
        assert f"| `{field}` |" in doc, field
    for engine, d in ENGINE_DEFAULTS.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{engine}` |"))
        assert f"| {d['capacity']} " in row, row
        assert f"{d['start_timeout']:g} s" in row if "start_timeout" in d else "| - |" in row, row


def test_the_example_in_the_docs_is_valid():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "catalog.md").read_text()
    block = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    cat = parse_catalog_text(block, "docs/catalog.md")
    assert cat.resolve("qwen") is not None and cat.resolve("tiny") is not None


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_valid(path):
    assert load_catalog_file(path).models


def test_an_external_profile_inherits_only_the_defaults_that_apply_and_never_echoes_a_key():
    from llmgw.errors import CatalogInvalid

    cat = parse_catalog({"defaults": {"replicas": 3, "env": {"HF_HOME": "/x"}, "priority": 5, "start_timeout": 60},
                         "models": [{"name": "q", "profiles": [
                             {"name": "sim", "engine": "sim"},
                             {"name": "api", "engine": "external", "url": ["https://api.example", "http://10.0.0.2:80"],
                              "api_key_env": "HOSTED_KEY"}]}]})
    sim, api = cat.model("q").profiles
    assert (sim.replicas, sim.env, sim.priority) == (3, {"HF_HOME": "/x"}, 5)
    assert (api.replicas, api.env, api.priority, api.start_timeout, api.urls) == (
        0, {}, 5, 120.0, ["https://api.example", "http://10.0.0.2:80"])
    assert parse_catalog(cat.canonical()) == cat  # the stored, resolved form validates as is
    with pytest.raises(CatalogInvalid) as e:
        parse_catalog({"models": [{"name": "q", "profiles": [
            {"name": "api", "engine": "external", "url": "https://user:sk-SECRET1@api.example",
             "api_key_env": "sk-SECRET2"}]}]})
    assert "SECRET" not in str(e.value) and len(e.value.problems) == 2


def test_remote_sources_are_valid_where_their_engine_loads_them():
    cat = parse_catalog_text("""
models:
  - name: qwen
    source: hf://Qwen/Qwen2.5-7B-Instruct@v1
    profiles:
      - {name: gpu, engine: vllm, gpu: {class: l4}}
      - {name: cpu, engine: llamacpp, source: "hf://bartowski/Qwen2.5-7B-Instruct-GGUF/*Q4_K_M.gguf"}
      - {name: url, engine: llamacpp, source: "https://mirror.lan/qwen.gguf#sha256=""" + "a" * 64 + """"}
""")
    model = cat.model("qwen")
    assert [model.source_for(p) for p in model.profiles] == [
        "hf://Qwen/Qwen2.5-7B-Instruct@v1", "hf://bartowski/Qwen2.5-7B-Instruct-GGUF/*Q4_K_M.gguf",
        "https://mirror.lan/qwen.gguf#sha256=" + "a" * 64]
