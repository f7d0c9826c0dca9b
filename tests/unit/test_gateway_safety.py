"""The gateway's safety fixes without engines: the auth mode is validated, staleness on our own
clock, our own requests in a scrape, one gunicorn configuration (the rest of them, with fake
engines: tests/integration/test_gateway_safety.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import GatewaySettings, RoutingConfig
from gateway.routing.choice import RouteRequest
from llmgw.state.records import LoadRecord
from tests.support.clock import FakeClock
from tests.support.routers import polled
from tests.support.gateway_app import endpoint, server, store  # noqa: F401 - server, store: fixtures

ROOT = Path(__file__).resolve().parents[2]


def test_auth_mode_is_validated():
    from llmgw.errors import ConfigError

    assert GatewaySettings.from_env({"LLMGW_GATEWAY_AUTH": "required"}).auth == "required"
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_AUTH"):
        GatewaySettings.from_env({"LLMGW_GATEWAY_AUTH": "maybe"})


# --- our own clock ----------------------------------------------------------------------------------
def test_load_freshness_uses_when_we_first_saw_the_record(store):
    clock = FakeClock(2_000_000_000.0, mono=500.0)
    store.write_endpoints([endpoint("e1", "http://127.0.0.1:9")], "fp", 0)
    st, polls = polled(store, GatewaySettings(routing=RoutingConfig(stale_after=3)), clock)
    polls.refresh_endpoints()
    store.write_load(LoadRecord("e1", 12.0, True, running=4, waiting=9))  # the agent's clock is way off
    polls.refresh_loads()
    assert st.route(RouteRequest("m")).kind == "saturated"  # just seen: trusted
    clock.mono += 2.9
    polls.refresh_loads()  # same ts again: not new
    assert st.route(RouteRequest("m")).kind == "saturated"
    clock.mono += 0.2
    polls.refresh_loads()
    assert st.route(RouteRequest("m")).endpoint.id == "e1"  # no new sample for 3.1 s: stale, ignored


def test_our_own_requests_in_a_scrape_are_not_taken_for_other_gateways(store):
    clock = FakeClock(2_000_000_000.0, mono=500.0)
    store.write_endpoints([endpoint("e1", "http://127.0.0.1:9")], "fp", 0)  # capacity 4
    st, polls = polled(store, GatewaySettings(routing=RoutingConfig(stale_after=3)), clock)
    polls.refresh_endpoints()
    mine = [st.route(RouteRequest("m")) for _ in range(4)]
    clock.advance(0.3)
    store.write_load(LoadRecord("e1", clock.t, True, running=4, waiting=0))  # the agent scrapes: our 4
    clock.advance(0.6)
    for choice in mine:  # they finish before this gateway reads that scrape
        st.release(choice, 0.8)
    polls.refresh_loads()
    # The 4 in the scrape were ours and are done: the engine is free, not full of others' requests.
    assert st.route(RouteRequest("m")).endpoint.id == "e1"
    # Requests in a scrape that were not ours are others', and count against the capacity.
    clock.advance(0.4)
    store.write_load(LoadRecord("e1", clock.t, True, running=4, waiting=0))  # ours: 1 of them
    clock.advance(0.2)
    polls.refresh_loads()
    assert [st.route(RouteRequest("m")).kind] == ["saturated"]  # 1 + 3 others = 4


# --- one gunicorn configuration ---------------------------------------------------------------------
def conf_values(env: dict, tmp: Path) -> dict:
    """The config module's values as a fresh process sees them; its temporary files go under `tmp`
    (TMPDIR), so nothing it makes can outlive the test in /tmp, even when an assertion fails first."""
    code = ("import json, os, sys, gateway.gunicorn_conf as c\n"
            "print(json.dumps({'workers': c.workers, 'bind': c.bind, 'k': c.worker_class,"
            " 'prom': os.environ.get('PROMETHEUS_MULTIPROC_DIR'), 'cores': os.cpu_count(),"
            " 'early': 'prometheus_client' in sys.modules,"
            # gevent patches the worker after the master loaded this module: it must not have
            # imported clients that would then keep unpatched sockets or locks. (ssl and threading
            # are not on the list: gunicorn's own config module imports ssl, and logging threading,
            # before any config file is read.)
            " 'unpatchable': sorted(m for m in ('redis', 'requests', 'urllib3', 'http.client', 'gevent',"
            " 'gateway.app', 'gateway.server.pollers', 'gateway.upstream.client') if m in sys.modules)}))")
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("LLMGW_GATEWAY_") and k not in ("PORT", "PROMETHEUS_MULTIPROC_DIR")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "TMPDIR": str(tmp), **env},
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    import json

    return json.loads(out.stdout)


def test_gunicorn_conf_knobs_and_multiproc_dir(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    d = conf_values({"LLMGW_GATEWAY_WORKERS": "2"}, tmp)
    assert (d["workers"], d["bind"], d["k"]) == (2, "127.0.0.1:8080", "gateway.server.worker.GatewayWorker")
    # 2 workers: /metrics aggregates through a fresh temporary directory
    assert d["prom"] and Path(d["prom"]).is_dir() and Path(d["prom"]).parent == tmp
    # prometheus_client picks its mode when first imported: loading the config must not import it
    assert d["early"] is False and d["unpatchable"] == []
    os.rmdir(d["prom"])
    d = conf_values({"LLMGW_GATEWAY_WORKERS": "1", "PORT": "9000"}, tmp)
    assert (d["workers"], d["bind"], d["prom"]) == (1, "127.0.0.1:9000", None)
    d = conf_values({}, tmp)  # one worker per core by default
    assert d["workers"] == d["cores"]
    if d["prom"]:
        os.rmdir(d["prom"])
    d = conf_values({"LLMGW_GATEWAY_BIND": "0.0.0.0:8080", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, tmp)
    assert d["bind"] == "0.0.0.0:8080" and d["prom"] == str(tmp_path)
    assert list(tmp.iterdir()) == []  # a directory is made only when none was given


def test_the_master_gives_each_worker_a_row_and_frees_it_when_it_exits(tmp_path):
    """gunicorn's hooks as the master calls them (on_starting, pre_fork, child_exit) and post_fork as
    a worker does: rows are handed out, a dead worker's counts are dropped, its row is reused."""
    code = (
        "import json, types, gateway.gunicorn_conf as c\n"
        "server = types.SimpleNamespace(cfg=types.SimpleNamespace(workers=2))\n"
        "c.on_starting(server)\n"
        "w = [types.SimpleNamespace(pid=10 + i) for i in range(3)]\n"
        "c.pre_fork(server, w[0]); c.pre_fork(server, w[1])\n"
        "master = server.llmgw_siblings\n"
        "a, b = master.for_row(w[0].llmgw_row), master.for_row(w[1].llmgw_row)\n"
        "a.adopt(10); b.adopt(11); a.publish('e', 0, 2, 1.0)\n"
        "seen = b.others(['e'], 1.0)\n"
        "c.child_exit(server, w[0])\n"
        "after = b.others(['e'], 1.0)\n"
        "c.pre_fork(server, w[2])\n"
        "c.post_fork(server, w[2])\n"
        "print(json.dumps({'rows': [w[0].llmgw_row, w[1].llmgw_row, w[2].llmgw_row], 'n': master.rows,"
        " 'seen': seen, 'after': after, 'row': w[2].llmgw_siblings.row}))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_GATEWAY_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    import json

    d = json.loads(out.stdout)
    assert d["n"] == 6  # two rows per worker and two spare: a reload's new workers start beside the old
    assert d["rows"] == [0, 1, 0] and d["row"] == 0
    assert d["seen"] == {"e": 2} and d["after"] == {}


def test_procfile_and_compose_use_the_conf():
    import yaml

    proc = [line for line in (ROOT / "Procfile").read_text().splitlines() if line.startswith("gateway:")][0]
    assert "-c python:gateway.gunicorn_conf" in proc and "--threads" not in proc and " -w " not in proc
    svc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["gateway"]
    assert svc["command"][:3] == ["gunicorn", "-c", "python:gateway.gunicorn_conf"]
    assert svc["environment"]["LLMGW_GATEWAY_BIND"] == "0.0.0.0:8080" and svc["environment"]["REDIS_URL"]
    docs = (ROOT / "docs" / "gateway.md").read_text()
    for knob in ("LLMGW_GATEWAY_WORKERS", "LLMGW_GATEWAY_MAX_CONNECTIONS", "LLMGW_GATEWAY_BIND",
                 "PROMETHEUS_MULTIPROC_DIR", "LLMGW_GATEWAY_AUTH", "LLMGW_GATEWAY_START_WAIT",
                 "LLMGW_GATEWAY_REPORT_INTERVAL"):
        assert knob in docs, knob


def test_catalog_names_helper():
    import json

    import fakeredis

    from llmgw.state import keys
    from llmgw.state.store import Store

    r = fakeredis.FakeRedis(decode_responses=True)
    assert Store(r).catalog_names() == set()
    r.set(keys.CATALOG, json.dumps({"version": 1, "spec": {"models": [{"name": "a", "aliases": ["b"]}, {"name": "c"}]}}))
    assert Store(r).catalog_names() == {"a", "b", "c"}
    r.set(keys.CATALOG, "{broken")
    assert Store(r).catalog_names() == set()
