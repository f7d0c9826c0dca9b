"""What tracing costs one proxied request: the tracing calls the gateway's request path makes
(gateway.http.proxy and gateway.http.answer: the request, identify, admission, endpoint choice,
attempt, inject, first byte, finish), timed in a loop, per request.

    python -m bench.tracing [--requests 20000] [--repeat 5]

Cases:
- off: tracing off (no OTEL_EXPORTER_OTLP_ENDPOINT), the client sent no trace context;
- off, forwarded: tracing off, the client sent a traceparent and tracestate (checked, passed on);
- on: OpenTelemetry's SDK with a BatchSpanProcessor whose exporter drops the spans (the span
  bookkeeping a traced request costs the gateway; exporting is the processor's thread's).

The figure is the best of --repeat runs (CPU time of this process, per request), less the same loop
without the tracing calls. bench/gateway.py measures the whole gateway, where the off case is below
its noise.
"""

from __future__ import annotations

import argparse
import sys
import time

from gateway.observe.tracing import route_path
from llmgw.tracing import OFF, Tracing

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def one_request(tracing, environ: dict) -> None:
    """The calls one request that is sent at once and answered makes, in the gateway's order."""
    trace = environ["llmgw.trace"] = tracing.request(environ, "rid", "POST", route_path("chat"))
    trace.identify("m", "alice", "standard")
    trace.admitting(0)
    trace.choice("ep-1", "least expected completion", False)
    trace.admitted("send")
    headers = {"content-type": "application/json", "x-request-id": "rid"}
    trace.attempt(0, "ep-1", "http://127.0.0.1:9000/v1/chat/completions")
    trace.inject(headers)
    trace.first_byte()
    trace.finish(200, True, (12, 34))


def no_tracing(_tracing, environ: dict) -> None:
    """The same loop without a tracing call (the environ copy and the headers dict): subtracted."""
    environ["llmgw.trace"] = None
    headers = {"content-type": "application/json", "x-request-id": "rid"}
    headers.update(())


def per_request(request, tracing, environ: dict, n: int, repeat: int) -> float:
    """Best CPU seconds per request over `repeat` runs of `n` requests."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(n):
            request(tracing, dict(environ))
        best = min(best, (time.process_time() - t0) / n)
    return best


def sdk_tracing() -> Tracing:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    return Tracing(provider, "bench")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    base = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat/completions"}
    client = {**base, "HTTP_TRACEPARENT": TP, "HTTP_TRACESTATE": "congo=t61rcWkgMzE"}
    loop = per_request(no_tracing, OFF, base, args.requests, args.repeat)
    on = sdk_tracing()
    cases = [("off", OFF, base), ("off, forwarded", OFF, client),
             ("on (SDK, spans dropped)", on, client)]
    print(f"tracing calls per proxied request ({args.requests} requests, best of {args.repeat})")
    print(f"{'case':<26}{'cpu/req':>10}")
    for name, tracing, environ in cases:
        cost = per_request(one_request, tracing, environ, args.requests, args.repeat) - loop
        print(f"{name:<26}{max(cost, 0.0) * 1e6:>8.2f}µs")
    on.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
