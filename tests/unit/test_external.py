"""External servers on the control plane: stable endpoint ids, the derived state (table), the
checks (which answers pass), one pass on fakeredis with a fake HTTP seam and clock (records, events,
kicks, loads, removal), and the publisher listing the Ready ones."""

from __future__ import annotations

import pytest

from llmgw.catalog import apply_catalog, parse_catalog
from llmgw.state.kicks import PUBLISH, Kicker
from llmgw.state.records import ExternalRecord
from llmgw.state.replica_state import State, derive_external
from llmgw import surface as op
from tests.support.clock import FakeClock
from workers.control.external import (
    Check,
    ExternalConfig,
    assess,
    check,
    due,
    external_endpoints,
    external_id,
    external_once,
    targets,
)
from workers.control.housekeeping_pass import housekeeping_once
from workers.control.publish_pass import publish_once


def catalog(*profiles: dict, aliases=("q-alias",)):
    return parse_catalog({"models": [{"name": "q", "aliases": list(aliases), "profiles": list(profiles)}]})


LEGACY = {"name": "legacy", "engine": "external", "url": ["http://10.0.3.7:8000", "http://10.0.3.8:8000/"],
          "served_name": "Qwen/Qwen2.5-7B-Instruct", "api_key_env": "LEGACY_KEY", "priority": 0, "capacity": 24,
          "server": "vllm", "metrics": {}}


def test_endpoint_ids_are_stable_per_url():
    a = targets(catalog(LEGACY))
    b = targets(catalog({**LEGACY, "url": list(reversed(LEGACY["url"])) + ["http://10.0.3.9:8000"]}))
    assert {t.id for t in a} < {t.id for t in b}  # reordered and extended: the old ids stay
    assert a[1].url == "http://10.0.3.8:8000" and a[1].id == external_id("q", "legacy", "http://10.0.3.8:8000/")
    assert a[0].id.startswith("ext-q-legacy-") and a[0].health_url() == "http://10.0.3.7:8000/health"
    generic = targets(catalog({"name": "api", "engine": "external", "url": "https://api.example/openai"}))[0]
    assert generic.health_url() == "https://api.example/openai/v1/models"


def rec(**kw) -> ExternalRecord:
    return ExternalRecord(**{"id": "e", "model": "q", "profile": "p", "url": "http://h", **kw})


@pytest.mark.parametrize("record,state,reason", [
    (None, State.CHECKING, "not health-checked yet"),
    (rec(), State.CHECKING, "not health-checked yet"),
    (rec(checked_at=5, ok=True, last_ok_at=5), State.READY, ""),
    (rec(checked_at=6, ok=False, failures=1, last_ok_at=5, error="connection refused"), State.READY,
     "1 check in a row failed: connection refused"),
    (rec(checked_at=8, ok=False, failures=3, last_ok_at=5, error="timed out"), State.UNREACHABLE,
     "3 checks in a row failed: timed out"),
    (rec(checked_at=8, ok=False, failures=3, last_ok_at=5, error="x", unreachable_after=5), State.READY,
     "3 checks in a row failed: x"),
    (rec(checked_at=1, ok=False, failures=1, error="connection refused"), State.UNREACHABLE,
     "never answered: connection refused"),
])
def test_the_state_of_an_external_url(record, state, reason):
    assert derive_external(record).state is state and derive_external(record).reason == reason


def test_assess_counts_failures_in_a_row_and_stamps_changes():
    t = targets(catalog(LEGACY))[0]
    r1 = assess(None, t, Check(True, context_length=32768), 10.0, 3)
    assert (r1.failures, r1.last_ok_at, r1.changed_at, r1.context_length) == (0, 10.0, 10.0, 32768)
    r2 = assess(r1, t, Check(False, "HTTP 503 from /health"), 15.0, 3)
    r3 = assess(r2, t, Check(False, "timed out"), 20.0, 3)
    assert derive_external(r3).state is State.READY and r3.changed_at == 10.0
    r4 = assess(r3, t, Check(False, "timed out"), 25.0, 3)
    assert derive_external(r4).state is State.UNREACHABLE and r4.changed_at == 25.0 and r4.error == "timed out"
    r5 = assess(r4, t, Check(True), 30.0, 3)
    assert derive_external(r5).state is State.READY and r5.failures == 0 and r5.context_length == 32768
    assert due(None, 0, 5) and due(r5, 35.0, 5) and not due(r5, 34.0, 5)


class FakeHttp:
    """Answers per url: (status, body), or an OSError to raise; `fetch` serves /metrics."""

    def __init__(self, answers: dict):
        self.answers, self.asked = answers, []

    def get(self, url, timeout):
        self.asked.append(url)
        a = self.answers.get(url, OSError("connection refused"))
        if isinstance(a, Exception):
            raise a
        return a

    def fetch(self, url, timeout):
        status, body = self.get(url, timeout)
        if status >= 400:
            raise OSError(f"HTTP {status}")
        return body.decode()


def test_which_answers_pass_a_health_check():
    vllm = targets(catalog(LEGACY))[0]
    api = targets(catalog({"name": "api", "engine": "external", "url": "https://api.example"}))[0]
    models = b'{"data": [{"id": "x", "max_model_len": 8192}]}'
    http = FakeHttp({vllm.url + "/health": (200, b""), vllm.url + "/v1/models": (200, models),
                     api.url + "/v1/models": (401, b"")})
    assert check(vllm, http, 1, want_context=True) == Check(True, None, 8192)
    assert check(api, http, 1, want_context=True) == Check(True, None, None)  # up, it wants the gateway's key
    http.answers[vllm.url + "/health"] = (503, b"")
    assert check(vllm, http, 1, want_context=False) == Check(False, "HTTP 503 from /health")
    http.answers[api.url + "/v1/models"] = (404, b"")
    assert check(api, http, 1, want_context=False) == Check(False, "HTTP 404 from /v1/models")
    del http.answers[vllm.url + "/health"]
    assert check(vllm, http, 1, want_context=False) == Check(False, "connection refused")


class SentKicks:
    def __init__(self):
        self.sent = []

    def __call__(self, task, countdown):
        self.sent.append(task)


METRICS = "vllm:num_requests_running 3\nvllm:num_requests_waiting 1\nvllm:generation_tokens_total 50\n"


def test_a_pass_checks_scrapes_publishes_and_forgets(store):
    clock = FakeClock(1000.0)
    cat = catalog(LEGACY)
    apply_catalog(store, cat, source="t", applied_by="t", now=clock.time())
    a, b = targets(cat)
    http = FakeHttp({a.url + "/health": (200, b""), a.url + "/v1/models": (200, b'{"data": [{"max_model_len": 4096}]}'),
                     a.url + "/metrics": (200, METRICS.encode())})
    kicks = SentKicks()
    cfg = ExternalConfig(check_interval=5, timeout=1, unreachable_after=2)
    run = lambda: external_once(store, http, clock.time, cfg, kicker=Kicker(store, kicks))  # noqa: E731

    assert run() == {"checked": 2, "scraped": 0, "changed": 2, "removed": 0}
    states = {r.id: derive_external(r).state for r in store.external_records()}
    assert states == {a.id: State.READY, b.id: State.UNREACHABLE} and kicks.sent == [PUBLISH]
    events = [e["kind"] for _, e in store.r.xrange("llmgw:events") if e["kind"].startswith("external")]
    assert sorted(events) == ["external_ready", "external_unreachable"]

    version = publish_once(store, clock.time)
    _, _, eps = store.read_endpoints()
    [ep] = eps
    assert version and ep.id == a.id and ep.url == a.url and ep.engine == "external"
    assert (ep.models, ep.served_name, ep.capacity, ep.priority, ep.api_key_env) == (
        ("q", "q-alias"), "Qwen/Qwen2.5-7B-Instruct", 24, 0, "LEGACY_KEY")
    assert ep.paths[op.TOKENIZE] == "/tokenize"  # server: vllm

    clock.advance(1)  # not due yet: only the Ready one is scraped, through vLLM's names
    assert run()["scraped"] == 1 and http.asked.count(a.url + "/health") == 1
    load = store.loads([a.id])[a.id]
    assert (load.ok, load.running, load.waiting, load.generation_tokens_total, load.context_length) == (
        True, 3.0, 1.0, 50.0, 4096)

    del http.answers[a.url + "/health"]  # it stops answering: out after two failed checks in a row
    clock.advance(5)
    run()
    assert derive_external(store.external_records()[0]).state is State.READY
    clock.advance(5)
    run()
    assert {derive_external(r).state for r in store.external_records()} == {State.UNREACHABLE}
    publish_once(store, clock.time)
    assert store.read_endpoints().endpoints == []

    housekeeping_once(store, clock.time())  # an external url keeps its load sample
    assert a.id in store.loads([a.id])
    apply_catalog(store, catalog({"name": "gpu", "engine": "sim"}), source="t", applied_by="t", now=clock.time(),
                  expected_version=1)
    assert run()["removed"] == 2 and store.external_records() == [] and store.loads([a.id]) == {}


def test_external_profiles_run_no_replicas_and_list_only_ready_urls():
    cat = catalog({"name": "gpu", "engine": "sim", "replicas": 2}, LEGACY)
    assert cat.total_replicas() == 2
    a, b = targets(cat)
    recs = [rec(id=a.id, url=a.url, checked_at=1, ok=True, last_ok_at=1),
            rec(id=b.id, url="http://elsewhere", checked_at=1, ok=True, last_ok_at=1)]  # a stale url: not listed
    [ep] = external_endpoints(cat, recs)
    assert ep.id == a.id
    assert (ep.objective, ep.kv_tokens) == ("", None)
    # The model's routing objective and the profile's KV size reach the gateways as for any replica.
    tuned = parse_catalog({"models": [{"name": "q", "routing": {"objective": "completion"},
                                       "profiles": [{**LEGACY, "kv_cache_tokens": 65536}]}]})
    [ep] = external_endpoints(tuned, [rec(id=a.id, url=a.url, checked_at=1, ok=True, last_ok_at=1)])
    assert (ep.objective, ep.kv_tokens) == ("completion", 65536)


def test_status_lists_external_urls_with_state_and_reason():
    from llmgw.cli.status import build_status, render

    recs = [rec(id="ext-q-p-aaaaaa", url="http://a:8000", checked_at=995.0, ok=True, last_ok_at=995.0),
            rec(id="ext-q-p-bbbbbb", url="http://b:8000", checked_at=998.0, ok=False, failures=3, last_ok_at=900.0,
                error="connection refused")]
    report = build_status({}, [], {}, [], 4, 1, 2, 1000.0, listed={"ext-q-p-aaaaaa"}, externals=recs)
    rows = {x["id"]: x for x in report["externals"]}
    assert rows["ext-q-p-aaaaaa"]["state"] == "Ready" and rows["ext-q-p-aaaaaa"]["listed"]
    assert rows["ext-q-p-bbbbbb"]["state"] == "Unreachable" and "connection refused" in rows["ext-q-p-bbbbbb"]["reason"]
    text = render(report)
    assert "EXTERNAL SERVERS (2)" in text and "http://b:8000" in text and "3 checks in a row failed" in text
    assert "EXTERNAL" not in render(build_status({}, [], {}, [], 4, 1, 2, 1000.0))
