"""The gateway's gunicorn settings, the one source for the Procfile, docker-compose and `llmgw up`:

    gunicorn -c python:gateway.gunicorn_conf 'gateway:create_app()'

- gevent worker: each connection is a greenlet (a few kilobytes), so a process holds thousands of
  open streams; gunicorn patches the worker with gevent before it loads the app. This module is
  imported by the master before any patching: it imports nothing that opens sockets or starts threads.
- LLMGW_GATEWAY_WORKERS, LLMGW_GATEWAY_BIND, PORT: read through `gateway.config.GunicornSettings`
  (defaults and meanings there and in docs/gateway.md). Capacity and routing count every worker's
  traffic (through the scraped load), so more workers do not multiply a replica's capacity.
- Each worker, before it accepts its first connection (post_worker_init): raises its open-file limit,
  sizes its connection cap (LLMGW_GATEWAY_MAX_CONNECTIONS, gevent's worker_connections follows it)
  and waits for the endpoint list and the key table (gateway.server.boot).
- In-flight counts shared by the workers (gateway.server.siblings): the master makes the table on
  start (kept on gunicorn's arbiter) and gives each worker a row as it forks (pre_fork/post_fork,
  kept on the worker object, which hands it to the app factory as it makes its app:
  gateway.server.worker), freed when the worker exits, so the workers route as one router
  instead of seeing each other only in the engines' scrapes.
- PROMETHEUS_MULTIPROC_DIR: with more than one worker /metrics needs it; when unset a fresh temporary
  directory is made here (before the workers fork, so they all inherit it). Stale files of a previous
  run are removed at start, and a dead worker's live gauges when it exits.
- LLMGW_GATEWAY_CERTFILE, LLMGW_GATEWAY_KEYFILE: when set, gunicorn serves HTTPS with them (TLS at the
  gateway; the usual alternative is a reverse proxy in front, docs/gateway.md).
- SIGTERM: the workers stop accepting, let open streams finish for up to graceful_timeout, then exit.
Command-line flags still override every value.
"""

import glob
import os
import shutil
import tempfile

from gateway.config import GunicornSettings
from gateway.server import siblings

_settings = GunicornSettings.from_env()
# gunicorn's gevent worker that closes idle keep-alive connections when told to stop (gateway.server.worker).
worker_class = "gateway.server.worker.GatewayWorker"
workers = _settings.workers
bind = _settings.address
# The listen queue: a burst of clients connecting at once waits here until a worker accepts them.
# gunicorn's default (2048) overflowed at 4,096 clients opening their connections together, and the
# kernel dropped the SYNs of the rest, who then waited out TCP's retransmit backoff (1 s, 3 s, 7 s,
# ...): a TTFT p99 over 60 s (`python -m bench.streams --at-once`, docs/gateway.md). The kernel caps
# it at net.core.somaxconn (see `on_starting`).
backlog = _settings.backlog
# The gevent worker tells the master it is alive every second from its own greenlet: a worker
# silent for this long has its event loop stuck (a request hogging the CPU), not a long stream.
timeout = 30
graceful_timeout = 30
keepalive = 75
if _settings.certfile is not None:
    certfile, keyfile = str(_settings.certfile), str(_settings.keyfile)
# gunicorn >= 25.1 opens a control socket at one fixed path per user ($HOME/.gunicorn/gunicorn.ctl);
# a second gateway (or `llmgw up` beside a Procfile run) on the machine would collide with it.
control_socket_disable = True

# Set before any worker imports prometheus_client (it picks its mode on import; `gateway/__init__`
# therefore imports nothing eagerly).
_made_dir: str | None = None
if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _made_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="llmgw-gateway-metrics-")


def somaxconn() -> int | None:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def on_starting(server):
    """A previous run's value files would be summed into this run's counters: remove them. The
    sibling table gets two rows per worker: a reload's new workers start while the old ones finish."""
    server.llmgw_siblings = siblings.setup(2 * server.cfg.workers + 2 if server.cfg.workers > 1 else 0)
    cap = somaxconn()
    asked = getattr(server.cfg, "backlog", backlog)  # a command line's --backlog wins
    if cap is not None and cap < asked and cap < 4096:
        server.log.warning("the kernel caps the listen queue at %d connections (net.core.somaxconn), under the "
                           "%d asked (LLMGW_GATEWAY_BACKLOG): a burst of more clients connecting at once has "
                           "SYNs dropped and waits out TCP's retransmits; raise it with `sysctl -w "
                           "net.core.somaxconn=%d`", cap, asked, min(asked, 65535))
    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
        for f in glob.glob(os.path.join(d, "*.db")):
            os.unlink(f)


def pre_fork(server, worker):
    table = getattr(server, "llmgw_siblings", None)
    worker.llmgw_row = table.claim_row() if table is not None else None


def post_fork(server, worker):
    worker.llmgw_siblings = siblings.attach(getattr(server, "llmgw_siblings", None), worker.llmgw_row)


def post_worker_init(worker):
    """In the worker, after the app is loaded and gevent patched, before the first connection."""
    from gateway.server.boot import start

    start(worker)


def on_exit(server):  # noqa: ARG001 - gunicorn's hook signature
    if _made_dir:
        shutil.rmtree(_made_dir, ignore_errors=True)


def child_exit(server, worker):
    table, row = getattr(server, "llmgw_siblings", None), getattr(worker, "llmgw_row", None)
    if table is not None and row is not None:
        table.free_row(row)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
