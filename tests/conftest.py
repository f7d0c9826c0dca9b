"""Fixtures shared by every test: the process-leak detector and a real Redis; and, at the end of a run,
what was skipped and why, grouped by reason (harness/needs.py says what a skipped test needed).

The leak detector gives each test its own LLMGW_TEST_TOKEN in the environment; every process the
test starts (and every engine those start) inherits it. After the test, any live process still
carrying it is killed and the test fails, naming the processes.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter

import pytest

from harness.cluster import Cluster
from tests.support.fake_upstream import FakeUpstream
from harness.procs import TOKEN_VAR, describe, kill_pids, processes_with_token, wait_until


@pytest.fixture(autouse=True)
def no_leaked_processes(monkeypatch, request):
    token = uuid.uuid4().hex
    monkeypatch.setenv(TOKEN_VAR, token)
    # With setproctitle installed (vLLM's router, in the `bench` extra, brings it), celery and
    # gunicorn rewrite their title over the environment, and the token could no longer be found.
    monkeypatch.setenv("SPT_NOENV", "1")
    yield token
    # Processes stopped a moment ago may still be exiting; give them a short, bounded while.
    try:
        wait_until(lambda: not processes_with_token(token), 5, what="test processes to exit")
    except AssertionError:
        leaked = processes_with_token(token)
        names = "\n".join(describe(p) for p in leaked)
        kill_pids(leaked)
        pytest.fail(f"test left processes running:\n{names}", pytrace=False)


@pytest.fixture
def cluster(tmp_path, request):
    """A Cluster whose processes are stopped (and their logs printed on failure) after the test."""
    c = Cluster(tmp_path)
    yield c
    c.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(c.logs())


@pytest.fixture
def upstreams():
    """Make in-process fake engines (tests/support/fake_upstream.py: `upstreams(speed=2, ...)`); all are
    stopped, their threads joined, when the test ends."""
    ups = []

    def make(**kw):
        u = FakeUpstream(**{"base": 0.005, **kw}).start()
        ups.append(u)
        return u

    yield make
    for u in ups:
        u.stop()


@pytest.fixture
def redis_server(cluster):
    """A real redis-server on a free port; yields its URL."""
    return cluster.start_redis()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def pytest_collection_modifyitems(config, items):
    # Keep the fast tests first: a broken unit shows up before minutes of end-to-end and fault runs.
    items.sort(key=lambda it: ("tests/faults" in str(it.fspath), "tests/e2e" in str(it.fspath),
                               "tests/integration" in str(it.fspath)))
    os.environ.setdefault("LLMGW_TESTING", "1")


def skip_reason(report) -> str:
    """A skip's reason as pytest keeps it, without pytest's `Skipped: ` prefix."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    # Outermost, so the list comes after pytest's own short summary, just above the final counts.
    yield
    reasons = Counter(skip_reason(r) for r in terminalreporter.stats.get("skipped", ()))
    if reasons:
        terminalreporter.write_sep("=", "what was skipped, and why")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"skipped: {n} ({reason})")


@pytest.fixture
def traced():
    """A Tracing over OpenTelemetry's in-memory exporter: (tracing, exporter)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llmgw.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Tracing(provider, "test"), exporter
    provider.shutdown()
