"""Optional gunicorn settings for the gateway: `gunicorn -c python:gateway.gunicorn_conf 'gateway:create_app()'`.

Defaults suited to proxying long streams (gthread, many threads per worker) and, when
PROMETHEUS_MULTIPROC_DIR is set, the hook that drops a dead worker's live gauges from /metrics.
Every value can still be overridden on the command line.
"""

import os

worker_class = "gthread"
workers = int(os.environ.get("LLMGW_GATEWAY_WORKERS", "2"))
threads = int(os.environ.get("LLMGW_GATEWAY_THREADS", "128"))  # each open stream holds a thread
bind = os.environ.get("LLMGW_GATEWAY_BIND", "0.0.0.0:8080")
timeout = 0  # gthread heartbeats from the main thread; a long stream is not a hung worker
graceful_timeout = 30
keepalive = 75


def child_exit(server, worker):  # noqa: ARG001 - gunicorn's hook signature
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
