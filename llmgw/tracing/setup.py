"""Whether this process traces, from the standard OpenTelemetry environment, and its one provider.

On when an OTLP endpoint is set (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT),
or when OTEL_TRACES_EXPORTER names `console`; off when OTEL_SDK_DISABLED=true or
OTEL_TRACES_EXPORTER=none, and otherwise. The SDK itself reads the rest: OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES (the resource), OTEL_TRACES_SAMPLER / _ARG (the sampler; by default the
client's sampled flag decides, and a new trace is sampled), and the exporter's headers, timeout,
compression and certificates. The provider is made once per process, in the process that serves
(the SDK re-arms its export thread after a fork), like logging's configuration.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping

from llmgw.tracing.tracer import OFF, Off, Tracing

log = logging.getLogger("llmgw.tracing")

PROTOCOLS = {"http/protobuf": "otlp-http", "grpc": "otlp-grpc"}


@dataclass(frozen=True)
class Plan:
    """What the environment asks for: the exporters to use (none: off), why, and what it asks for
    that cannot be done (each logged as a warning)."""

    exporters: tuple[str, ...]  # "otlp-http", "otlp-grpc", "console"
    endpoint: str | None
    why: str
    problems: tuple[str, ...] = ()


def _get(environ: Mapping[str, str], *names: str) -> str:
    for n in names:
        value = (environ.get(n) or "").strip()
        if value:
            return value
    return ""


def plan(environ: Mapping[str, str]) -> Plan:
    """Decide from the environment (pure)."""
    if _get(environ, "OTEL_SDK_DISABLED").lower() == "true":
        return Plan((), None, "OTEL_SDK_DISABLED=true")
    names = [n.strip().lower() for n in _get(environ, "OTEL_TRACES_EXPORTER").split(",") if n.strip()] or ["otlp"]
    if "none" in names:
        return Plan((), None, "OTEL_TRACES_EXPORTER=none")
    endpoint = _get(environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT") or None
    exporters: list[str] = []
    problems: list[str] = []
    for name in dict.fromkeys(names):
        if name == "console":
            exporters.append("console")
        elif name == "otlp":
            if endpoint is None:
                continue
            protocol = _get(environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
            if protocol.lower() in PROTOCOLS:
                exporters.append(PROTOCOLS[protocol.lower()])
            else:
                problems.append(f"OTLP protocol {protocol!r} is not supported: use http/protobuf (or grpc with "
                                "opentelemetry-exporter-otlp-proto-grpc installed); spans are not exported over OTLP")
        else:
            problems.append(f"OTEL_TRACES_EXPORTER names {name!r}, which llmgw does not ship: use otlp, console or none")
    if exporters:
        return Plan(tuple(exporters), endpoint, "exporting to " + ", ".join(exporters), tuple(problems))
    why = "no OTEL_EXPORTER_OTLP_ENDPOINT" if endpoint is None else "no usable exporter"
    return Plan((), endpoint, why, tuple(problems))


def _exporter(name: str, timeout: float | None = None):
    """The exporter `name` (a Plan's); `timeout`: seconds an export may take, retries included (else
    the exporter's own, from OTEL_EXPORTER_OTLP_TIMEOUT or 10)."""
    kw = {} if timeout is None else {"timeout": timeout}
    if name == "otlp-http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(**kw)
    if name == "otlp-grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        except ImportError:
            log.warning("OTLP over gRPC needs the package opentelemetry-exporter-otlp-proto-grpc, which is not "
                        "installed; spans are not exported over OTLP (or set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf)")
            return None
        return Grpc(**kw)
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter()


def build(service: str, environ: Mapping[str, str] | None = None, export_timeout: float | None = None) -> Tracing | Off:
    """This process's tracing as the environment asks, service name `service` unless
    OTEL_SERVICE_NAME (or `service.name` in OTEL_RESOURCE_ATTRIBUTES) says otherwise. Never raises:
    tracing that cannot be set up is logged and left off. `export_timeout`: the most seconds an
    export may take, unless OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT says (a short-lived command exports
    when it exits, and must not wait out a collector that is down)."""
    environ = os.environ if environ is None else environ
    p = plan(environ)
    if _get(environ, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        export_timeout = None
    for problem in p.problems:
        log.warning("tracing: %s", problem)
    if not p.exporters:
        log.debug("tracing off: %s", p.why)
        return OFF
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": service}))
        provider = TracerProvider(resource=resource)
        exporters = [e for e in (_exporter(name, export_timeout) for name in p.exporters) if e is not None]
        if not exporters:
            return OFF
        for e in exporters:
            provider.add_span_processor(BatchSpanProcessor(e))
    except Exception as e:  # noqa: BLE001 - a process serves without tracing rather than not at all
        log.error("tracing off: cannot set up OpenTelemetry: %s: %s", type(e).__name__, e)
        return OFF
    name = resource.attributes.get("service.name")
    log.info("tracing on: %s as service %s%s", p.why, name, f" ({p.endpoint})" if p.endpoint else "")
    return Tracing(provider, str(name))


class _Process:
    """The process's tracing, configured once (the first `configure` wins)."""

    tracing: Tracing | Off | None = None


def configure(service: str, export_timeout: float | None = None) -> Tracing | Off:
    """Set up this process's tracing from its environment, once, and make its provider the global
    one (so spans of libraries that use OpenTelemetry join the same traces). `export_timeout`: see
    `build` (the CLI's)."""
    if _Process.tracing is None:
        t = build(service, export_timeout=export_timeout)
        if isinstance(t, Tracing):
            from opentelemetry import trace

            trace.set_tracer_provider(t.provider)
        _Process.tracing = t
    return _Process.tracing


def active() -> Tracing | Off:
    """The tracing `configure` set up in this process; off when it was never called."""
    return _Process.tracing or OFF
