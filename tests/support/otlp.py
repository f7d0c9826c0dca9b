"""An OTLP/HTTP collector stand-in for tests of processes that export their spans (llmgw.tracing):
it decodes each export (opentelemetry-proto, shipped with the OTLP exporter) into its spans."""

from __future__ import annotations

import gzip
import http.server
import threading

import pytest


class Collector:
    """Keeps (service name, span) for every span exported to it; `url` is OTEL_EXPORTER_OTLP_ENDPOINT."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list = []
        got = self.spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(h):  # noqa: N802, N805 - stdlib name; `h` is the handler
                body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
                if h.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        got.extend((service, s) for s in ss.spans)
                h.send_response(200)
                h.send_header("Content-Length", "0")
                h.end_headers()

            def log_message(h, *args):  # noqa: N805
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def named(self, name: str) -> list:
        return [(svc, s) for svc, s in list(self.spans) if s.name == name]

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def attribute(span, key: str):
    """A decoded span's attribute value (string, int or bool), or None."""
    for a in span.attributes:
        if a.key == key:
            v = a.value
            return getattr(v, v.WhichOneof("value"))
    return None


def roots(spans) -> dict:
    """The gateway's request spans by request id: {rid: (service, span)}."""
    out = {}
    for service, s in spans:
        if s.name != "POST /v1/chat/completions":
            continue
        rid = next((a.value.string_value for a in s.attributes if a.key == "llmgw.request_id"), None)
        out[rid] = (service, s)
    return out
