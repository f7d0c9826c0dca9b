"""The Procfile, docker-compose.yml, README and .ci/run agree with each other and with the CLI."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"redis", "control", "beat", "node", "gateway", "flower"}


def procfile() -> dict[str, str]:
    out = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, cmd = line.partition(":")
            out[name.strip()] = cmd.strip()
    return out


def test_procfile_has_every_role():
    procs = procfile()
    assert set(procs) == ROLES
    assert "-Q control" in procs["control"] and "-Q node-" in procs["node"]
    # gunicorn's settings (gevent, workers, bind) come from one file, gateway/gunicorn_conf.py
    assert "gateway:create_app()" in procs["gateway"] and "-c python:gateway.gunicorn_conf" in procs["gateway"]
    assert 'worker_class = "gevent"' in (ROOT / "gateway" / "gunicorn_conf.py").read_text()


def test_compose_services_match_procfile():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    # The default services are the Procfile's roles; the rest come only with a profile (monitoring).
    assert {name for name, svc in doc["services"].items() if not svc.get("profiles")} == ROLES


def test_docker_compose_config_passes():
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        cmd = ["docker", "compose", "config", "-q"]
    elif shutil.which("docker-compose"):
        cmd = ["docker-compose", "config", "-q"]
    else:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (make install adds the latter)")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    head = readme.split("## ", 1)[0]
    assert "make up" in head and "make test" in head
    assert "exec make test" in ci

