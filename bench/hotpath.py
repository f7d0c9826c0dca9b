"""The gateway's own code on the request path, profiled: one gateway app in this process (no gunicorn, no
gevent), its WSGI entry called back to back for a JSON and a streamed chat request to a fast fake
engine (bench/fast_engine.py) on loopback. Prints the microseconds of the gateway's CPU per request
(this process's CPU time over the loop, the engine's excluded) and cProfile's top functions; then what
two parts every request pays cost alone, called 100,000 times each: the check of its common fields
(gateway.request.fields) and the explain hooks of a request that does not ask (gateway.observe.explain),
too small for the whole request's figure to resolve.

    python -m bench.hotpath [--requests 3000] [--top 20] [--set KEY=VALUE ...] [--rooms]

What gunicorn adds on top (parsing, the response head, the socket writes) is bench/gateway.py's
`floor-answer` row; this is the part that is llmgw's to make cheaper. `--set` passes a gateway
setting (`LLMGW_GATEWAY_...=...`) to see what one part of the path costs. `--rooms` prints, for one
request of each kind, how many times its way through the code enters each of the gateway's modules
(a call from another module into it): a request that keeps going back into the same rooms is a shell
whose decisions leaked out of one place.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

from bench import peers

BODY = json.dumps({"model": "m", "messages": [{"role": "system", "content": "You are a helpful assistant. " * 8},
                                              {"role": "user", "content": "hi"}]}).encode()
SBODY = json.dumps({"model": "m", "stream": True, "messages": json.loads(BODY)["messages"]}).encode()


def environ(body: bytes) -> dict:
    return {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat/completions", "QUERY_STRING": "",
            "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(body)), "SERVER_PROTOCOL": "HTTP/1.1",
            "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(body), "REMOTE_ADDR": "127.0.0.1",
            "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8080", "HTTP_HOST": "127.0.0.1:8080",
            "wsgi.errors": sys.stderr}


def one(wsgi, body: bytes) -> int:
    status = []
    out = wsgi(environ(body), lambda s, h, exc=None: status.append(s))
    try:
        for _ in out:
            pass
    finally:
        close = getattr(out, "close", None)
        if close is not None:
            close()
    return int(status[0][:3])


GENERATOR = inspect.CO_GENERATOR


def rooms(wsgi, body: bytes) -> dict[str, int]:
    """Per gateway module, how many times one request's way through the code enters it from another
    (the server reading a stream's body piece by piece is not counted)."""
    entered: dict[str, int] = {}

    def prof(frame, event, arg):
        if event != "call" or frame.f_code.co_flags & GENERATOR:  # (a body's pieces, read by the server)
            return
        mod = frame.f_globals.get("__name__", "")
        back = frame.f_back
        if mod.startswith("gateway.") and (back is None or back.f_globals.get("__name__") != mod):
            entered[mod] = entered.get(mod, 0) + 1

    sys.setprofile(prof)
    try:
        one(wsgi, body)
    finally:
        sys.setprofile(None)
    return dict(sorted(entered.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rooms", action="store_true", help="print the modules one request enters, and how often")
    a = ap.parse_args()
    for kv in a.set:
        k, _, v = kv.partition("=")
        os.environ[k] = v

    from harness.cluster import Cluster
    from harness.procs import free_port, wait_until

    cluster = Cluster(Path(tempfile.mkdtemp(prefix="llmgw-hotpath-")))
    try:
        cluster.start_redis()
        engines = peers.start_engines(cluster.procs, 2, 0.0, 8, wait_until, free_port)
        store = cluster.store()
        peers.register(store, engines)
        os.environ["REDIS_URL"] = cluster.redis_url
        from gateway.app import create_app
        from gateway.config import GatewaySettings

        app = create_app(GatewaySettings.from_env())
        gw = app.extensions["llmgw"]
        gw.start()
        wait_until(lambda: gw.not_ready() is None, 20, what="the gateway's tables")
        wsgi = app.wsgi_app
        for name, body in (("json", BODY), ("stream", SBODY)):
            for _ in range(200):  # warm: pools, caches, the learner's first samples
                assert one(wsgi, body) == 200
            if a.rooms:
                print(f"{name}: modules entered by one request (entries from another module): "
                      + ", ".join(f"{m} {n}" for m, n in rooms(wsgi, body).items()))
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.requests):
                one(wsgi, body)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            print(f"{name}: {cpu / a.requests * 1e6:.0f} us of gateway CPU per request "
                  f"({a.requests} requests, {a.requests / wall:.0f}/s, one at a time; this process's CPU, "
                  "background loops included)")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.requests):
                one(wsgi, body)
            prof.disable()
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("cumulative").print_stats(a.top)
            st.sort_stats("tottime").print_stats(a.top)
            print("\n".join(line for line in s.getvalue().splitlines()
                            if line.strip() and not line.startswith(("   Ordered by", "   List reduced"))))
        print(parts())
        gw.stop()
    finally:
        cluster.stop()


def parts(n: int = 100_000) -> str:
    """The CPU of the per-request checks added to the path, each called alone `n` times (less the loop's)."""
    from gateway.observe.explain import ExplainLog, Explaining, explained_wsgi
    from gateway.request.fields import check
    from llmgw import surface
    from llmgw.tracing import OFF

    def per(fn) -> float:
        c0 = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - c0) / n * 1e6

    loop = per(lambda: None)
    body, sbody = json.loads(BODY), json.loads(SBODY)
    fields = per(lambda: check(body, surface.CHAT)) - loop, per(lambda: check(sbody, surface.CHAT)) - loop
    env = environ(BODY)
    explaining = Explaining(OFF, ExplainLog(), time.time, time.monotonic, lambda e: None, lambda k: "")
    hooks = per(lambda: explaining.request(env, "r", "POST", "/v1/chat/completions")) - \
        per(lambda: OFF.request(env, "r", "POST", "/v1/chat/completions"))
    app = lambda e, s: None  # noqa: E731
    wrapped = explained_wsgi(app)
    hooks += per(lambda: wrapped(env, None)) - per(lambda: app(env, None))
    return (f"alone: fields.check {fields[0]:.2f} us per json request, {fields[1]:.2f} us per stream request; "
            f"the explain hooks {hooks:.2f} us per request that does not ask ({n} calls each, less the loop's)")


if __name__ == "__main__":
    main()
