"""How a gateway worker process starts serving (gunicorn's `post_worker_init`, gateway.gunicorn_conf):
raise its file-descriptor limit, size its connection cap to fit it, then start the background loops
and wait for the endpoint list and the key table before gunicorn accepts the first connection. (The
app was given its row of the sibling table as it was made: gateway.server.worker.)

Imported only inside the worker, after gevent has patched it: nothing here may be imported by the
gunicorn master.
"""

from __future__ import annotations

import logging
import resource

from gateway.config import DEFAULT_MAX_CONNECTIONS

log = logging.getLogger("llmgw.gateway")

# File descriptors a process needs besides its requests: Redis clients, listening sockets, logs,
# Prometheus value files, pipes.
FD_RESERVE = 64
# Connections gunicorn still accepts beyond the cap: their requests get the 503 that says so (the
# cap counts requests), and /healthz, /readyz and /metrics keep answering.
HEADROOM = 256


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (the default soft 1024 would cap a process at
    about 400 streams); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else target
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
        return soft


def connection_cap(configured: int, fd_limit: int) -> int:
    """Requests one process may hold open: the configured cap, lowered so that each one's two
    sockets (client and engine), the headroom and the reserve fit in `fd_limit`."""
    return max(1, min(configured, (fd_limit - FD_RESERVE - HEADROOM) // 2))


def start(worker) -> None:
    """gunicorn's post_worker_init: runs in the worker after the app is loaded, before it serves."""
    gw = getattr(worker.wsgi, "extensions", {}).get("llmgw")
    if gw is None:  # not the gateway app: nothing of ours to start
        return
    fds = raise_fd_limit()
    wanted = gw.cfg.max_connections or DEFAULT_MAX_CONNECTIONS
    cap = connection_cap(wanted, fds)
    if cap < wanted:
        (log.warning if gw.cfg.max_connections else log.info)(
            "%d open requests need about %d file descriptors; the limit is %d, so this process holds "
            "at most %d (LLMGW_GATEWAY_MAX_CONNECTIONS; raise `ulimit -n` for more)",
            wanted, 2 * wanted + FD_RESERVE + HEADROOM, fds, cap)
    gw.max_open = cap
    worker.worker_connections = cap + HEADROOM  # gevent's pool: read by the worker's run()
    gw.serve(gw.cfg.start_wait, tick=worker.notify)
