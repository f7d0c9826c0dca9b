"""The floor under the gateway's CPU per request: what a request costs on the gateway's own server model
(gunicorn's gevent worker, the gateway's gunicorn config) before any routing or accounting.

- `answer`: a WSGI app that reads the request and answers it itself, as the fast engine would (JSON,
  or the 8 SSE events at once): what gunicorn and gevent cost per request.
- `proxy`: a WSGI app that passes the request to an engine over the gateway's own engine client
  (gateway.upstream.client: pooled keep-alive sockets) and relays the answer: what the least a Python
  proxy on this server model costs. The engines are in FLOOR_ENGINES (comma-separated URLs), used in turn.

`python -m bench.gateway --targets ...,floor-answer,floor-proxy` runs them beside the gateway:
llmgw's CPU per request minus `floor-proxy`'s is what routing, keys, metrics and accounting cost;
`floor-proxy`'s minus vLLM's router's is the price of Python and gunicorn.
"""

from __future__ import annotations

import itertools
import os

from gateway.upstream.client import Upstream

JSON = (b'{"id":"c","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":'
        b'{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,'
        b'"completion_tokens":2,"total_tokens":10}}')
EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,'
         b'"delta":{"content":"tok "},"finish_reason":null}]}\n\n')


def answer(environ, start_response):
    body = environ["wsgi.input"].read()
    if b'"stream": true' in body or b'"stream":true' in body:
        start_response("200 OK", [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")])
        return [EVENT] * 8 + [b"data: [DONE]\n\n"]
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(JSON)))])
    return [JSON]


_upstream = Upstream(2.0, 120.0, 1024)
_engines = itertools.cycle([u for u in os.environ.get("FLOOR_ENGINES", "").split(",") if u])


def proxy(environ, start_response):
    body = environ["wsgi.input"].read()
    resp = _upstream.send(next(_engines), "/v1/chat/completions", body, {"content-type": "application/json"})
    headers = [(k, v) for k, v in resp.headers if k.lower() in ("content-type",)]
    if resp.chunked:
        start_response(f"{resp.status} OK", headers)

        def relay():
            try:
                yield from resp.chunks()
                resp.release()
            finally:
                resp.close()

        return relay()
    data = b"".join(resp.chunks())
    resp.release()
    start_response(f"{resp.status} OK", headers + [("Content-Length", str(len(data)))])
    return [data]
