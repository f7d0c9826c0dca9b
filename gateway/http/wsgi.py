"""The WSGI entry: proxied paths (gateway.request.surface) skip Flask's request machinery and go to the
Proxy; everything else is a Flask view. Past LLMGW_GATEWAY_MAX_CONNECTIONS open requests a flood gets
a cheap 503; a stream keeps its place until it ends, relayed to the socket under gunicorn's gevent
worker (gateway.upstream.relay).
"""

from __future__ import annotations

import itertools
import logging
import os

from gateway.errors import ApiError
from gateway.http.answer import OpenRequests, error_response
from gateway.http.proxy import Proxy
from gateway.observe.metrics import Metrics
from gateway.request.surface import match
from gateway.upstream.relay import relay, relay_target
from gateway.upstream.stream import StreamBody
from llmgw.tracing import NOOP_REQUEST

log = logging.getLogger("llmgw.gateway")


def fast_path(proxy: Proxy, open_requests: OpenRequests, metrics: Metrics, flask_wsgi):
    # A request's id when the client sent none: this process's random prefix and a counter, 32 hex
    # digits as a uuid4's (uuid4 showed in the gateway's CPU per request: `python -m bench.hotpath`).
    # Built after gunicorn forks (create_app runs in each worker), so every worker has its own prefix.
    prefix, counter = os.urandom(8).hex(), itertools.count()

    def wsgi(environ, start_response):
        path = environ.get("PATH_INFO", "")
        matched = match(environ.get("REQUEST_METHOD", ""), path)
        if matched is None:
            return flask_wsgi(environ, start_response)
        rid = environ.get("HTTP_X_REQUEST_ID") or f"{prefix}{next(counter) & 0xFFFFFFFFFFFFFFFF:016x}"
        if open_requests.n >= open_requests.cap:
            # Beyond the cap a flood gets a cheap answer instead of memory and file descriptors.
            metrics.over_capacity.inc()
            return error_response(ApiError(
                "gateway_full", f"this gateway process already holds {open_requests.cap} open requests "
                "(LLMGW_GATEWAY_MAX_CONNECTIONS); retry shortly", 1), rid)(environ, start_response)
        open_requests.n += 1
        handed_over = False
        try:
            resp = proxy(matched[0], matched[1], environ, rid)
            handed_over = isinstance(resp.body, StreamBody)  # the stream gives the count back
        except ApiError as e:
            proxy.refused(environ, e)
            resp = error_response(e, rid)
        except Exception:  # noqa: BLE001 - never a traceback to the client
            log.exception("unhandled error on %s %s", environ.get("REQUEST_METHOD"), path)
            err = ApiError("internal", "internal error in the gateway; see its log")
            environ.get("llmgw.trace", NOOP_REQUEST).refused(err.status, err.kind, err.message)
            resp = error_response(err, rid)
        finally:
            if not handed_over:
                open_requests.n -= 1
        if handed_over:
            gresp = relay_target(environ, start_response)
            if gresp is not None:  # gunicorn's gevent worker: the stream goes straight to the socket
                return relay(resp, gresp, start_response)
        return resp(environ, start_response)

    return wsgi
