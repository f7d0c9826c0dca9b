"""The request-path benchmarks' fleet and the proxies they compare (bench/gateway.py,
bench/streams.py): fast fake engines (bench/fast_engine.py), and in front of them nginx, vLLM's
router (`vllm-router`, pip extra `bench`) and llmgw's gateway, each started on a free port and
stopped with the run. `Target` says how to reach one and which processes to charge its CPU to.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Target:
    name: str
    urls: list[str]
    pids: Callable[[], list[int]] | None  # the proxy's processes (None: the engines themselves)


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (gunicorn's workers, nginx's)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of `pids` so far (from /proc/<pid>/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        try:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def start_engines(procs, n: int, answer: float, events: int, wait_until, free_port) -> list[str]:
    """`n` bench/fast_engine.py processes; their URLs."""
    import requests

    urls = []
    for i in range(n):
        port = free_port()
        procs.start(f"engine-{i}", [sys.executable, "-m", "bench.fast_engine", str(port), "--answer", str(answer),
                                    "--events", str(events)], cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda url=url: requests.get(url + "/health", timeout=1).ok, 15, what=f"engine {i}")
        urls.append(url)
    return urls


def nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


NGINX_CONF = """
worker_processes {workers};
worker_rlimit_nofile 40000;
daemon off;
master_process on;
user root root;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 20000; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fcgi;
    uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
    upstream engines {{
        {policy}
        {servers}
        keepalive 1024;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=65535;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def start_nginx(procs, workdir: Path, engines: list[str], port: int, least_conn: bool = True, name: str = "nginx"):
    """nginx in front of `engines` (least_conn, or round robin), one worker per core; None when it is
    not installed (apt-get install nginx)."""
    nginx = nginx_binary()
    if nginx is None:
        return None
    d = workdir / name
    d.mkdir(parents=True, exist_ok=True)
    servers = " ".join(f"server {u.split('//')[1]};" for u in engines)
    (d / "nginx.conf").write_text(NGINX_CONF.format(workers=os.cpu_count() or 1, dir=d, servers=servers, port=port,
                                                    policy="least_conn;" if least_conn else ""))
    return procs.start(name, [nginx, "-c", str(d / "nginx.conf"), "-p", str(d)])


def vllm_router_binary() -> str | None:
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


def start_vllm_router(procs, engines: list[str], port: int, free_port, policy: str = "round_robin",
                      name: str = "vllm-router"):
    """vLLM's router (Rust) in front of `engines`; None when it is not installed (pip extra `bench`)."""
    binary = vllm_router_binary()
    if binary is None:
        return None
    # Its metrics port too: the default 29000 may be held by another vllm-router or smg on the machine.
    return procs.start(name, [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines,
                              "--policy", policy, "--log-level", "warning", "--prometheus-port", str(free_port())])


def register(store, engines: list[str], model: str = "m", served: str = "m") -> None:
    """The engines as the endpoint list a gateway routes by (no agent, no control plane)."""
    from llmgw.state.records import EndpointInfo

    store.write_endpoints([EndpointInfo(id=f"e{i}", url=u, models=(model,), engine="sim", model=model,
                                        served_name=served) for i, u in enumerate(engines)], "bench", time.time())
