"""The diff shown before applying: pure data, then lines."""

from __future__ import annotations

from llmgw.catalog import diff_catalogs, format_diff, parse_catalog_text

OLD = """
models:
  - name: keep
    profiles: [{name: s, engine: sim, replicas: 1}]
  - name: scale
    profiles: [{name: s, engine: sim, replicas: 1}, {name: gone, engine: sim, replicas: 2}]
  - name: restart
    profiles: [{name: s, engine: sim, replicas: 1}]
  - name: old
    aliases: [o]
    profiles: [{name: s, engine: sim, replicas: 3}]
"""
NEW = """
models:
  - name: keep
    profiles: [{name: s, engine: sim, replicas: 1}]
  - name: scale
    profiles: [{name: s, engine: sim, replicas: 4, priority: 5}, {name: extra, engine: sim, replicas: 1}]
  - name: restart
    aliases: [r]
    profiles: [{name: s, engine: sim, replicas: 1, args: ["--speed", "2"]}]
  - name: new
    profiles: [{name: s, engine: sim, replicas: 2}]
"""


def test_diff_models_profiles_and_replicas():
    d = diff_catalogs(parse_catalog_text(OLD), parse_catalog_text(NEW))
    kinds = {m.model: m.kind for m in d.models}
    assert kinds == {"scale": "changed", "restart": "changed", "new": "added", "old": "removed"}
    scale = next(m for m in d.models if m.model == "scale")
    prof = {p.profile: p for p in scale.profiles}
    assert prof["s"].kind == "changed" and (prof["s"].replicas_before, prof["s"].replicas_after) == (1, 4)
    assert not prof["s"].restart and {c.field for c in prof["s"].changes} == {"replicas", "priority"}
    assert prof["extra"].kind == "added" and prof["extra"].replicas_after == 1
    assert prof["gone"].kind == "removed" and prof["gone"].replicas_before == 2
    restart = next(m for m in d.models if m.model == "restart")
    assert [c.field for c in restart.changes] == ["aliases"]
    assert restart.profiles[0].restart  # args and names change the process
    assert (d.replicas_before, d.replicas_after) == (8, 9)
    assert not d.empty


def test_format_diff_lines():
    old, new = parse_catalog_text(OLD), parse_catalog_text(NEW)
    text = "\n".join(format_diff(diff_catalogs(old, new), new))
    assert "~ model scale" in text
    assert "~ profile scale/s: replicas 1 -> 4; priority 0 -> 5 [live]" in text
    assert "+ profile scale/extra: 1 replica (sim, cpu, priority 0)" in text
    assert "- profile scale/gone: 2 replicas stop" in text
    assert "~ model restart: aliases [] -> [\"r\"]" in text
    assert "[replicas restart]" in text
    assert "+ model new" in text and "- model old" in text
    assert text.splitlines()[-1] == "1 added, 2 changed, 1 removed; replicas 8 -> 9"


def test_no_changes_and_first_apply():
    new = parse_catalog_text(NEW)
    assert diff_catalogs(new, parse_catalog_text(NEW)).empty
    assert format_diff(diff_catalogs(new, new)) == ["no changes"]
    first = diff_catalogs(None, new)
    assert all(m.kind == "added" for m in first.models) and first.replicas_before == 0


def test_fields_outside_the_launch_spec_apply_live():
    old = parse_catalog_text("models: [{name: m, profiles: [{name: s, engine: sim, replicas: 1}]}]")
    new = parse_catalog_text(
        "models: [{name: m, profiles: [{name: s, engine: sim, replicas: 1, start_timeout: 30,"
        " pool: cpu, metrics: {running: 'x:running'}}]}]")
    d = diff_catalogs(old, new)
    prof = d.models[0].profiles[0]
    assert not prof.restart
    assert {c.field for c in prof.changes} == {"start_timeout", "pool", "metrics"}
    assert format_diff(d, new)[1].endswith("[live]")
