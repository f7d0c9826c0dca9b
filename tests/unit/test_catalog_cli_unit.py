"""`llmgw catalog apply` in-process on fakeredis: the compare-and-set seen from the command line."""

from __future__ import annotations

import fakeredis
import pytest

from llmgw.catalog import apply_catalog, parse_catalog_text, read_applied
from llmgw.cli import catalog as cli_catalog
from llmgw.cli import main
from llmgw.state import keys
from llmgw.state.store import Store

TEXT = "models:\n  - {name: m, profiles: [{name: s, engine: sim, replicas: %d}]}\n"


@pytest.fixture
def r(monkeypatch):
    client = fakeredis.FakeRedis(decode_responses=True)
    monkeypatch.setattr(cli_catalog, "connect", lambda url, **kw: client)
    return client


def test_someone_else_applies_between_diff_and_apply(r, tmp_path, monkeypatch, capsys):
    apply_catalog(Store(r), parse_catalog_text(TEXT % 1), source="a", applied_by="a")
    f = tmp_path / "mine.yaml"
    f.write_text(TEXT % 5)
    real = cli_catalog.read_applied

    def read_then_someone_applies(store):
        seen = real(store)  # the version the diff is made against
        apply_catalog(store, parse_catalog_text(TEXT % 9), source="b", applied_by="intruder")
        return seen

    monkeypatch.setattr(cli_catalog, "read_applied", read_then_someone_applies)
    assert main(["catalog", "apply", str(f)]) == 1
    out = capsys.readouterr()
    assert "expected version 1, found 2" in out.err and "nothing was applied" in out.err
    version, cat, meta = read_applied(Store(r))
    assert version == 2 and meta["applied_by"] == "intruder" and cat.model("m").profiles[0].replicas == 9
    assert r.llen(keys.CATALOG_HISTORY) == 2


def test_dry_run_writes_nothing_and_apply_prints_the_new_version(r, tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text(TEXT % 2)
    assert main(["catalog", "apply", str(f), "--dry-run"]) == 0
    assert "+ model m" in capsys.readouterr().out and r.get(keys.CATALOG) is None
    assert main(["catalog", "apply", str(f)]) == 0
    assert "applied catalog version 1" in capsys.readouterr().out
    assert main(["catalog", "apply", str(f)]) == 0
    assert "unchanged: catalog version 1" in capsys.readouterr().out
    assert r.llen(keys.CATALOG_HISTORY) == 1
