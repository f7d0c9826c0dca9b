"""The Procfile, docker-compose.yml, README and .ci/run agree with each other and with the CLI."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness import needs

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"redis", "control", "beat", "node", "gateway", "flower", "batch"}


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
    assert "-Q control" in procs["control"] and "-Q node-" in procs["node"] and "-Q batch" in procs["batch"]
    # gunicorn's settings (gevent, workers, bind) come from one file, gateway/gunicorn_conf.py
    assert "gateway:create_app()" in procs["gateway"] and "-c python:gateway.gunicorn_conf" in procs["gateway"]
    assert 'worker_class = "gateway.server.worker.GatewayWorker"' in (ROOT / "gateway" / "gunicorn_conf.py").read_text()


def test_compose_services_match_procfile():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    # The default services are the Procfile's roles; the rest come only with a profile (monitoring).
    assert {name for name, svc in doc["services"].items() if not svc.get("profiles")} == ROLES


def compose_tool() -> list[str] | None:
    """`docker compose` or `docker-compose`, whichever is installed (None: neither)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


COMPOSE_TOP = {"version", "name", "services", "volumes", "networks", "configs", "secrets"}
SERVICE_KEYS = {"image", "build", "command", "environment", "depends_on", "restart", "volumes", "ports",
                "healthcheck", "env_file", "entrypoint", "working_dir", "user", "networks", "deploy", "labels",
                "profiles"}


def compose_problems(doc) -> list[str]:
    """What `docker compose config` would refuse in a compose document, as far as llmgw's file uses
    the format: unknown keys, a service without image or build, commands that are not lists of
    strings, bad environments, dependencies, volumes and ports, healthchecks without a test."""
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict) or not doc["services"]:
        return ["no services"]
    problems = [f"unknown top-level key {k!r}" for k in doc if k not in COMPOSE_TOP and not k.startswith("x-")]
    services, volumes = doc["services"], doc.get("volumes") or {}
    for name, svc in services.items():
        if not isinstance(svc, dict):
            problems.append(f"{name}: not a mapping")
            continue
        problems += [f"{name}: unknown key {k!r}" for k in svc if k not in SERVICE_KEYS]
        if "image" not in svc and "build" not in svc:
            problems.append(f"{name}: neither image nor build")
        cmd = svc.get("command")
        if cmd is not None and not (isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd)):
            problems.append(f"{name}: command is not a list of strings")
        env = svc.get("environment", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                                for k, v in env.items()):
            problems.append(f"{name}: environment is not a mapping of names to values")
        problems += [f"{name}: depends on unknown service {d!r}" for d in svc.get("depends_on", [])
                     if d not in services]
        for v in svc.get("volumes", []):
            source = v.split(":", 1)[0] if isinstance(v, str) and ":" in v else None
            if source is None:
                problems.append(f"{name}: volume {v!r} is not source:target")
            elif not source.startswith((".", "/", "~")) and source not in volumes:
                problems.append(f"{name}: named volume {source!r} is not declared under volumes")
        for p in svc.get("ports", []):
            if not (isinstance(p, str) and re.fullmatch(r"(\d+\.\d+\.\d+\.\d+:)?(\d+:)?\d+(/(tcp|udp))?", p)):
                problems.append(f"{name}: port {p!r} is not [ip:][host:]container")
        hc = svc.get("healthcheck")
        if hc is not None and not (isinstance(hc, dict) and hc.get("test")):
            problems.append(f"{name}: healthcheck without a test")
    return problems


def test_compose_structure_checker_finds_mistakes():
    """The Python check is what validates the file where no compose tool is installed: it must be
    able to fail."""
    good = {"services": {"a": {"image": "x", "command": ["run"], "volumes": ["data:/d"], "ports": ["8080:80"]}},
            "volumes": {"data": None}, "x-anchor": {}}
    assert compose_problems(good) == []
    bad = {"services": {"a": {"command": "run", "depends_on": ["b"], "volumes": ["nope:/d"], "ports": [80],
                              "healthcheck": {"interval": "5s"}, "environment": {"X": [1]}, "comand": ["x"]}},
           "volume": {}}
    assert len(compose_problems(bad)) == 9, compose_problems(bad)


def test_docker_compose_file_is_valid():
    """The structural check in Python, on every machine."""
    assert compose_problems(yaml.safe_load((ROOT / "docker-compose.yml").read_text())) == []


def test_docker_compose_accepts_the_file():
    """The compose tool's own check (`docker compose config`); `make test` installs no compose tool
    (.ci/run does), so a user's machine without one skips this with the reason."""
    tool = compose_tool()
    needs.require("docker compose or docker-compose", None if tool else "neither is installed")
    proc = subprocess.run([*tool, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    head = readme.split("## ", 1)[0]
    assert "make up" in head and "make test" in head
    assert "exec make test" in ci



def test_make_installs_nothing_system_wide():
    """`make test` and `make up` only touch .venv and the user's cache; system packages are .ci/run's job."""
    makefile = (ROOT / "Makefile").read_text()
    assert not re.search(r"\b(apt-get|apt|sudo|dnf|yum|brew)\b", makefile)
    assert "apt-get install" in (ROOT / ".ci" / "run").read_text()


def test_the_image_builds_the_engine_like_make_install():
    """One set of build flags: the Dockerfile builds llama-server with the Makefile's `engine` target."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "make engine" in dockerfile and "CMAKE_ARGS" not in dockerfile
    assert "python -m llmgw.engines.selfcheck" in dockerfile
