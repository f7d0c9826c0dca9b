"""The catalog's `autoscale` block, `scheduling_priority` and durations: resolved defaults, every bad
block refused at its exact path with its reason (nothing written to Redis), and edits taken live."""

from __future__ import annotations

import fakeredis
import pytest

from llmgw.catalog import apply_catalog, diff_catalogs, format_diff, parse_catalog_text
from llmgw.catalog.fields import parse_duration
from llmgw.catalog.types import IDLE_AFTER, Catalog
from llmgw.cli import catalog as cli_catalog
from llmgw.cli import main
from llmgw.errors import CatalogInvalid
from llmgw.state.store import Store
from tests.unit.test_catalog_invalid import snapshot

P = "models[0].profiles[0]"
A = f"{P}.autoscale"


def profile_text(profile: str, defaults: str = "") -> str:
    head = f"defaults: {defaults}\n" if defaults else ""
    return f"{head}models:\n  - name: m\n    profiles:\n      - {profile}\n"


def one(profile: str, defaults: str = ""):
    return parse_catalog_text(profile_text(profile, defaults)).models[0].profiles[0]


@pytest.mark.parametrize("text,seconds", [
    (5, 5.0), (1.5, 1.5), ("5s", 5.0), ("2m", 120.0), ("1h", 3600.0), ("1h30m", 5400.0), ("500ms", 0.5),
    ("1m30s", 90.0), ("0.5s", 0.5),
])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "5x", "s", "2m1h", "1 h", "-5s", "5sec"])
def test_bad_durations_say_how_to_write_one(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_defaults_are_resolved_into_the_stored_catalog():
    p = one("{name: s, engine: sim, autoscale: {max: 4}}")
    a = p.autoscale
    assert (a.min, a.max, a.target, a.scale_up_after, a.scale_down_after, a.idle_after, a.cold_start_timeout) == \
        (1, 4, 0.7, 5.0, 120.0, None, 180.0)
    assert p.replicas == 1 and p.min_replicas == 1 and p.scheduling_priority == 0
    zero = one("{name: s, engine: sim, autoscale: {min: 0, max: 2, scale_up_after: 1s, idle_after: 2m}}")
    assert zero.replicas == 0 and zero.autoscale.idle_after == 120.0 and zero.autoscale.scale_up_after == 1.0
    assert one("{name: s, engine: sim, autoscale: {min: 0, max: 2}}").autoscale.idle_after == IDLE_AFTER
    # What is stored reads back as the same catalog (the resolved form passes the structural check).
    cat = parse_catalog_text(profile_text("{name: s, engine: sim, autoscale: {min: 0, max: 2}}"))
    assert Catalog.model_validate(cat.canonical()) == cat
    assert one("{name: s, engine: sim, replicas: 3}").min_replicas == 3


def test_start_and_drain_timeouts_accept_durations():
    p = one("{name: s, engine: sim, start_timeout: 10m, drain_timeout: 1m30s}")
    assert (p.start_timeout, p.drain_timeout) == (600.0, 90.0)


def test_a_profile_naming_one_count_does_not_inherit_the_other_from_defaults():
    assert one("{name: s, engine: sim, autoscale: {max: 3}}", defaults="{replicas: 2}").autoscale.max == 3
    p = one("{name: s, engine: sim, replicas: 3}", defaults="{autoscale: {max: 4, min: 0}}")
    assert p.autoscale is None and p.replicas == 3
    inherited = one("{name: s, engine: sim}", defaults="{autoscale: {max: 4, min: 0}}")
    assert inherited.autoscale.max == 4 and inherited.replicas == 0


BOTH = "`replicas` and `autoscale` together"
# (id, profile, defaults, the path a problem must name, a fragment of its reason)
CASES = [
    ("replicas-and-autoscale", "{name: s, engine: sim, replicas: 2, autoscale: {max: 3}}", "", A, BOTH),
    ("both-in-defaults", "{name: s, engine: sim}", "{replicas: 2, autoscale: {max: 3}}", "defaults.autoscale", BOTH),
    ("min-above-max", "{name: s, engine: sim, autoscale: {min: 5, max: 3}}", "", f"{A}.min", "min 5 is above max 3"),
    ("max-zero", "{name: s, engine: sim, autoscale: {min: 0, max: 0}}", "", f"{A}.max", "at least 1, got 0"),
    ("max-missing", "{name: s, engine: sim, autoscale: {min: 0}}", "", f"{A}.max", "required"),
    ("min-negative", "{name: s, engine: sim, autoscale: {min: -1, max: 2}}", "", f"{A}.min", "at least 0"),
    ("target-zero", "{name: s, engine: sim, autoscale: {max: 2, target: 0}}", "", f"{A}.target", "greater than 0, got 0"),
    ("target-above-one", "{name: s, engine: sim, autoscale: {max: 2, target: 1.5}}", "", f"{A}.target",
     "at most 1, got 1.5"),
    ("target-string", "{name: s, engine: sim, autoscale: {max: 2, target: high}}", "", f"{A}.target", "must be a number"),
    ("duration-zero", "{name: s, engine: sim, autoscale: {max: 2, scale_up_after: 0s}}", "", f"{A}.scale_up_after",
     "greater than 0, got 0"),
    ("duration-negative", "{name: s, engine: sim, autoscale: {max: 2, scale_down_after: -5}}", "",
     f"{A}.scale_down_after", "greater than 0, got -5"),
    ("duration-garbage", "{name: s, engine: sim, autoscale: {max: 2, cold_start_timeout: soon}}", "",
     f"{A}.cold_start_timeout", "'soon' is not a duration"),
    ("duration-boolean", "{name: s, engine: sim, autoscale: {max: 2, scale_up_after: yes}}", "",
     f"{A}.scale_up_after", "got the boolean true"),
    ("idle-after-with-min-1", "{name: s, engine: sim, autoscale: {min: 1, max: 2, idle_after: 5m}}", "",
     f"{A}.idle_after", "only applies with min: 0"),
    ("unknown-key", "{name: s, engine: sim, autoscale: {max: 2, targt: 0.5}}", "", f"{A}.targt",
     "did you mean 'target'"),
    ("not-a-mapping", "{name: s, engine: sim, autoscale: 3}", "", A, "must be a mapping"),
    ("scheduling-priority-float", "{name: s, engine: sim, scheduling_priority: 1.5}", "", f"{P}.scheduling_priority",
     "whole number"),
    ("drain-timeout-garbage", "{name: s, engine: sim, drain_timeout: later}", "", f"{P}.drain_timeout",
     "not a duration"),
]


@pytest.fixture
def r():
    client = fakeredis.FakeRedis(decode_responses=True)
    base = parse_catalog_text(profile_text("{name: s, engine: sim, replicas: 2}"))
    apply_catalog(Store(client), base, source="base.yaml", applied_by="test", now=1.0)
    return client


@pytest.mark.parametrize("case_id,profile,defaults,path,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_autoscale_blocks_are_refused_at_their_path(case_id, profile, defaults, path, fragment, tmp_path, r,
                                                        monkeypatch, capsys):
    text = profile_text(profile, defaults)
    with pytest.raises(CatalogInvalid) as exc:
        parse_catalog_text(text)
    matching = [p for p in exc.value.problems if p.path == path]
    assert matching, [str(p) for p in exc.value.problems]
    assert any(fragment in p.reason for p in matching), [str(p) for p in matching]
    assert all("Input should" not in p.reason for p in exc.value.problems)

    f = tmp_path / "catalog.yaml"
    f.write_text(text)
    before = snapshot(r)
    monkeypatch.setattr(cli_catalog, "connect", lambda url, **kw: r)
    assert main(["catalog", "apply", str(f)]) == 2
    assert f"{path}: " in capsys.readouterr().err
    assert snapshot(r) == before


def test_autoscale_and_scheduling_priority_edits_restart_nothing():
    fixed = parse_catalog_text(profile_text("{name: s, engine: sim, replicas: 2}"))
    auto = parse_catalog_text(profile_text("{name: s, engine: sim, autoscale: {min: 0, max: 4}}"))
    tuned = parse_catalog_text(profile_text(
        "{name: s, engine: sim, scheduling_priority: 5, autoscale: {min: 0, max: 6, target: 0.5}}"))
    for old, new in ((fixed, auto), (auto, tuned), (tuned, fixed)):
        d = diff_catalogs(old, new)
        assert not d.models[0].profiles[0].restart
        assert format_diff(d, new)[1].endswith("[live]")
    lines = format_diff(diff_catalogs(auto, tuned), tuned)
    assert "autoscale.max 4 -> 6" in lines[1] and "autoscale.target 0.7 -> 0.5" in lines[1]
    assert "scheduling_priority 0 -> 5" in lines[1]
    added = format_diff(diff_catalogs(None, auto), auto)
    assert "+ profile m/s: autoscale 0..4" in added[1]
