"""`python -m llmgw catalog ...` as a user runs it, against a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.state import keys
from llmgw.state.store import connect

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "catalog.yaml"

V1 = """
models:
  - name: tiny
    aliases: [tiny-alias]
    profiles:
      - {name: sim, engine: sim, replicas: 2}
"""
V2 = """
models:
  - name: tiny
    aliases: [tiny-alias]
    profiles:
      - {name: sim, engine: sim, replicas: 3}
  - name: other
    profiles:
      - {name: sim, engine: sim, replicas: 1}
"""
BAD = """
models:
  - name: big
    source: org/big
    profiles:
      - {name: gpu, engine: vllm, replicas: -1}
"""


@pytest.fixture
def run(redis_server, tmp_path):
    def _run(*args: str, url: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, "REDIS_URL": url or redis_server}
        env.pop("LLMGW_REDIS_URL", None)
        return subprocess.run([sys.executable, "-m", "llmgw", "catalog", *args], env=env, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
    return _run


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr


def test_validate(run, tmp_path):
    ok = run("validate", str(EXAMPLE))
    assert ok.returncode == 0 and "ok (3 models" in ok.stdout
    bad = run("validate", write(tmp_path, "bad.yaml", BAD))
    no_traceback(bad)
    assert bad.returncode == 2
    lines = bad.stderr.splitlines()
    assert f"{tmp_path}/bad.yaml: models[0].profiles[0].replicas: must be at least 0, got -1 (line 6)" in lines
    assert f"{tmp_path}/bad.yaml: models[0].profiles[0].gpu: vllm needs a GPU class: say `gpu: {{class: ...}}`, or `device: cpu` to run vllm's CPU build (line 6)" in lines
    assert lines[-1].endswith("2 problems")


def test_apply_show_history_round_trip(run, tmp_path, redis_server):
    r = connect(redis_server)
    v1 = write(tmp_path, "v1.yaml", V1)

    dry = run("apply", v1, "--dry-run")
    assert dry.returncode == 0 and "+ model tiny" in dry.stdout and "dry run: nothing applied" in dry.stdout
    assert r.get(keys.CATALOG) is None

    first = run("apply", v1)
    assert first.returncode == 0, first.stderr
    assert "+ profile tiny/sim: 2 replicas" in first.stdout and "applied catalog version 1" in first.stdout

    again = run("apply", v1)
    assert again.returncode == 0 and "unchanged: catalog version 1" in again.stdout
    assert r.llen(keys.CATALOG_HISTORY) == 1

    show = run("show")
    assert show.returncode == 0 and "catalog version 1" in show.stdout
    assert any(line.split()[:4] == ["tiny", "sim", "sim", "2"] for line in show.stdout.splitlines()), show.stdout
    doc = json.loads(run("show", "--json").stdout)
    assert doc["version"] == 1 and doc["spec"]["models"][0]["aliases"] == ["tiny-alias"]
    assert doc["source"] == v1 and "@" in doc["applied_by"]

    second = run("apply", write(tmp_path, "v2.yaml", V2))
    assert second.returncode == 0
    assert "~ profile tiny/sim: replicas 2 -> 3 [live]" in second.stdout
    assert "+ model other" in second.stdout and "applied catalog version 2" in second.stdout

    hist = run("history", "-n", "5")
    rows = hist.stdout.splitlines()
    assert hist.returncode == 0 and rows[0].split()[:2] == ["VERSION", "APPLIED"]
    assert [row.split()[0] for row in rows[1:]] == ["2", "1"]
    assert json.loads(run("history", "-n", "1", "--json").stdout)[0]["version"] == 2
    old = json.loads(run("show", "--json", "--version", "1").stdout)
    assert old["spec"]["models"][0]["profiles"][0]["replicas"] == 2


def test_show_as_yaml_prints_what_was_applied_and_applies_again_unchanged(run, tmp_path, redis_server):
    r = connect(redis_server)
    assert run("apply", str(EXAMPLE)).returncode == 0
    shown = run("show", "-o", "yaml")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert text.startswith("# llmgw catalog version 1 (hash ") and f"# from {EXAMPLE}" in text
    assert "null" not in text and "tensor_parallel: 2" in text and "capacity" not in text  # 64 and 4: the engines'
    copy = write(tmp_path, "copy.yaml", text)
    again = run("apply", copy)
    assert again.returncode == 0 and "unchanged: catalog version 1" in again.stdout, again.stdout + again.stderr
    assert r.llen(keys.CATALOG_HISTORY) == 1
    edited = write(tmp_path, "edited.yaml", text.replace("replicas: 2\n    gpu:", "replicas: 3\n    gpu:", 1))
    changed = run("apply", edited)
    assert "~ profile qwen2.5-7b-instruct/h100: replicas 2 -> 3 [live]" in changed.stdout, changed.stdout
    assert "applied catalog version 2" in changed.stdout
    assert run("show", "--output", "yaml", "--version", "1").stdout == text  # a past version, the same way


def test_invalid_apply_changes_nothing(run, tmp_path, redis_server):
    r = connect(redis_server)
    assert run("apply", write(tmp_path, "v1.yaml", V1)).returncode == 0
    before = (r.get(keys.CATALOG), r.lrange(keys.CATALOG_HISTORY, 0, -1))
    bad = run("apply", write(tmp_path, "bad.yaml", BAD))
    no_traceback(bad)
    assert bad.returncode == 2 and "vllm needs a GPU class" in bad.stderr
    missing = run("apply", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    assert (r.get(keys.CATALOG), r.lrange(keys.CATALOG_HISTORY, 0, -1)) == before


def test_unreachable_redis_is_one_line_not_a_traceback(run, tmp_path):
    from harness.procs import free_port

    proc = run("apply", write(tmp_path, "v1.yaml", V1), url=f"redis://127.0.0.1:{free_port()}/0")
    no_traceback(proc)
    assert proc.returncode == 2 and "cannot reach Redis" in proc.stderr


def test_show_and_history_when_nothing_applied(run):
    assert "no catalog applied yet" in run("show").stdout
    assert "no catalog applied yet" in run("history").stdout
    assert json.loads(run("show", "--json").stdout) == {"version": 0, "spec": None}
    assert json.loads(run("show", "-o", "json").stdout) == {"version": 0, "spec": None}
    empty = run("show", "-o", "yaml")  # an empty file applied would remove every model: none is printed
    assert empty.returncode == 2 and empty.stdout == "" and "no catalog applied yet" in empty.stderr
