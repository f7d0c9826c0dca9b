"""LiteLLM's proxy as a peer of llmgw's gateway in bench/routing.py and bench/streams.py.

`litellm[proxy]` cannot join the project's `bench` extra: it pins gunicorn < 24, and the gateway
needs gunicorn >= 27 (`--no-control-socket`); installing it would downgrade the gateway's server. So
it gets a virtualenv of its own, made on first use under ~/.cache/llmgw/bench/litellm-<version>
(about 2 minutes on 2 cores; it is kept, keyed by the pinned version, so later runs start at once).
When it cannot be made (no network, pip fails) the caller leaves LiteLLM's column out with a message.

The proxy as a user would run it to balance self-hosted engines: one deployment per engine under the
same model name (`openai/<served name>` at the engine's /v1, a dummy key), `least-busy` routing (the
deployment with the fewest requests in flight from this worker: LiteLLM's least connections), and
its costly extras off: no database (so no spend or error logs written), no callbacks, LITELLM_LOG at
ERROR, the model cost map read from the package instead of fetched from GitHub at start, no master
key (llmgw's gateway runs without API keys here too). Its `--telemetry` flag is a no-op in this
version. Workers: as many as llmgw's gateway has, given by the caller.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "1.108.7"
VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "bench" / f"litellm-{VERSION}"
# A worker imports for tens of seconds on busy cores; uvicorn's default 5 s health check would kill
# it before it is ready, again and again (seen at a load average of 15 on 2 cores).
WORKER_HEALTHCHECK_S = 120
START_TIMEOUT_S = 300


def python() -> str | None:
    """The virtualenv's interpreter, the virtualenv made on first use; None, with the reason printed,
    when it cannot be made. Built in a temporary directory and renamed into place, so an interrupted
    install never looks finished (the proxy is started as `python -m`, which survives the rename)."""
    py = VENV / "bin" / "python"
    if py.exists():
        return str(py)
    print(f"LiteLLM: installing litellm[proxy]=={VERSION} into {VENV} (once, about 2 minutes)", flush=True)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=VENV.parent))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, capture_output=True, text=True)
        subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", f"litellm[proxy]=={VERSION}"],
                       check=True, capture_output=True, text=True)
        tmp.rename(VENV)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()[-1:]
        print(f"LiteLLM could not be installed ({' '.join(detail)}): its column is left out", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
        return str(py) if py.exists() else None  # another run may have finished it meanwhile
    return str(py)


def config(urls: list[str], served_name: str, capacities: list[int | None]) -> dict:
    """The proxy's config: one deployment per engine, least-busy. `capacities` (the engines' batch
    sizes, what llmgw is told) become each deployment's `max_parallel_requests`; None leaves it unset.
    LiteLLM answers 429 when a deployment's slots are all taken instead of holding the request, and
    counts them per worker."""
    deployments = []
    for url, cap in zip(urls, capacities, strict=True):
        params = {"model": f"openai/{served_name}", "api_base": url.rstrip("/") + "/v1", "api_key": "dummy"}
        if cap is not None:
            params["max_parallel_requests"] = cap
        deployments.append({"model_name": served_name, "litellm_params": params})
    return {
        "model_list": deployments,
        "router_settings": {"routing_strategy": "least-busy"},
        "litellm_settings": {"set_verbose": False, "callbacks": []},
        "general_settings": {"disable_spend_logs": True, "disable_error_logs": True,
                             "dangerously_permit_weak_or_unset_master_key": True},
    }


def start(procs, name: str, workdir: Path, py: str, cfg: dict, port: int, workers: int):
    """Starts the proxy on 127.0.0.1:`port` (procs: harness.procs.ProcessSet) and waits for
    /health/liveliness; returns its Proc (stopping it stops its whole process group)."""
    import requests
    import yaml

    from harness.procs import wait_until

    d = workdir / f"litellm-{port}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    # DATABASE_URL or LITELLM_MASTER_KEY in the caller's environment would turn on the database or the
    # key checks: the benchmarks are run without them.
    env = {"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = procs.start(name, [py, "-m", "litellm.proxy.proxy_cli", "--config", str(d / "config.yaml"),
                              "--host", "127.0.0.1", "--port", str(port), "--num_workers", str(workers),
                              "--timeout_worker_healthcheck", str(WORKER_HEALTHCHECK_S)], env=env, cwd=str(d))
    url = f"http://127.0.0.1:{port}"

    def live() -> bool:
        if not proc.alive():
            raise RuntimeError(f"LiteLLM exited at start:\n{proc.log(20)}")
        try:
            return requests.get(url + "/health/liveliness", timeout=2).ok
        except requests.RequestException:
            return False

    wait_until(live, START_TIMEOUT_S, interval=0.5, what="LiteLLM /health/liveliness")
    return proc
