"""deploy/: the Grafana dashboard asks only for metrics llmgw exports, through the data source Grafana is
provisioned with; Prometheus scrapes paths the gateway serves; docker-compose mounts files that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import fakeredis
import pytest
import yaml

from gateway.observe.batchmetrics import FAMILIES as BATCH_FAMILIES
from gateway.observe.fleetmetrics import FAMILIES
from gateway.observe.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "llmgw.json"
# PromQL words that are neither functions (followed by "(") nor metric names.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers not called as functions, once strings,
    label matchers, ranges and by/without/on/ignoring groupings are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[m.end():].lstrip().startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_the_parser_finds_metrics_and_skips_the_rest():
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{status=~"5..|x",p="a\\"}"}[5m]))) / '
            'max without (instance) (b) and on (job) c_total offset 5m')
    assert metric_names(expr) == {"a_bucket", "b", "c_total"}


def exported() -> set[str]:
    """Every series name llmgw exports: the gateway's /metrics and the fleet's /metrics/fleet."""
    names = set()
    for family in Metrics().registry.collect():
        names |= {family.name + s for s in SUFFIXES[family.type]}
    for name, (kind, _help, _labels) in {**FAMILIES, **BATCH_FAMILIES}.items():
        names |= {name + s for s in SUFFIXES[kind]}
    return names


def panels(doc: dict) -> list[dict]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def test_every_dashboard_query_names_only_metrics_llmgw_exports():
    doc = json.loads(DASHBOARD.read_text())
    known = exported()
    queries = [(p["title"], t["expr"]) for p in panels(doc) for t in p.get("targets", [])]
    assert len(queries) >= 15
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: {expr} names no metric"
        unknown = names - known
        assert not unknown, f"panel {title!r} asks for {sorted(unknown)}, which llmgw does not export"
    asked = {n for _t, e in queries for n in metric_names(e)}
    # What the issue asks the dashboard to show is there.
    for must in ("llmgw_gateway_requests_total", "llmgw_gateway_request_seconds_bucket",
                 "llmgw_gateway_ttft_seconds_bucket", "llmgw_gateway_shed_total", "llmgw_gateway_inflight",
                 "llmgw_fleet_replicas", "llmgw_control_pass_seconds_total"):
        assert must in asked


def test_the_dashboard_uses_the_provisioned_data_source():
    doc = json.loads(DASHBOARD.read_text())
    (ds,) = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    used = {json.dumps(p["datasource"], sort_keys=True) for p in panels(doc) if "datasource" in p}
    assert used == {json.dumps({"type": "prometheus", "uid": ds["uid"]}, sort_keys=True)}
    assert ds["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_what_the_gateway_serves():
    from gateway.app import create_app
    from gateway.config import GatewaySettings
    from llmgw.state.store import Store

    app = create_app(GatewaySettings(), store=Store(fakeredis.FakeRedis(decode_responses=True)))
    routes = {r.rule for r in app.url_map.iter_rules()}
    doc = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for job in doc["scrape_configs"]:
        assert job["metrics_path"] in routes
        for target in (t for sc in job["static_configs"] for t in sc["targets"]):
            service, port = target.split(":")
            assert service in compose["services"] and f"0.0.0.0:{port}" in str(compose["services"][service])


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_compose_monitoring_mounts_files_that_exist(service):
    svc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][service]
    assert svc["profiles"] == ["monitoring"]
    for volume in svc["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("./"):
            assert (ROOT / source).exists(), f"{service} mounts {source}, which does not exist"
