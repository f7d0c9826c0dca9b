"""The gateway's gunicorn settings, the one source for the Procfile, docker-compose and `llmgw up`:

    gunicorn -c python:gateway.gunicorn_conf 'gateway:create_app()'

- LLMGW_GATEWAY_WORKERS, LLMGW_GATEWAY_THREADS, LLMGW_GATEWAY_BIND, PORT: read through
  `gateway.config.GunicornSettings` (defaults and meanings there and in docs/gateway.md). Capacity
  and routing count every worker's traffic (through the scraped load), so more workers do not
  multiply a replica's capacity.
- PROMETHEUS_MULTIPROC_DIR: with more than one worker /metrics needs it; when unset a fresh temporary
  directory is made here (before the workers fork, so they all inherit it). Stale files of a previous
  run are removed at start, and a dead worker's live gauges when it exits.
Command-line flags still override every value.
"""

import glob
import os
import shutil
import tempfile

from gateway.config import GunicornSettings

_settings = GunicornSettings.from_env()
worker_class = "gthread"
workers = _settings.workers
threads = _settings.threads  # each open stream holds a thread
bind = _settings.address
timeout = 0  # gthread heartbeats from the main thread; a long stream is not a hung worker
graceful_timeout = 30
keepalive = 75
# gunicorn >= 25.1 opens a control socket at one fixed path per user ($HOME/.gunicorn/gunicorn.ctl);
# a second gateway (or `llmgw up` beside a Procfile run) on the machine would collide with it.
control_socket_disable = True

# Set before any worker imports prometheus_client (it picks its mode on import; `gateway/__init__`
# therefore imports nothing eagerly).
_made_dir: str | None = None
if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _made_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="llmgw-gateway-metrics-")


def on_starting(server):  # noqa: ARG001 - gunicorn's hook signature
    """A previous run's value files would be summed into this run's counters: remove them."""
    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
        for f in glob.glob(os.path.join(d, "*.db")):
            os.unlink(f)


def on_exit(server):  # noqa: ARG001 - gunicorn's hook signature
    if _made_dir:
        shutil.rmtree(_made_dir, ignore_errors=True)


def child_exit(server, worker):  # noqa: ARG001 - gunicorn's hook signature
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
