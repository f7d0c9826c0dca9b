"""Latency targets (llmgw.slo): how a duration is written, where a request's targets come from (its
headers, its key's defaults, its model's catalog `slo:`), the 400 that names a bad header, and
whether an answer met them."""

from __future__ import annotations

import io
import json

import pytest

from gateway.errors import ApiError
from gateway.request.call import Call
from gateway.request.plan import plan
from gateway.request.surface import ROUTES
from gateway.request.targets import asked
from gateway.routing.tables import tables_from
from llmgw.catalog import parse_catalog_text
from llmgw.catalog.slo import endpoint_fields
from llmgw.slo import NO_TARGETS, BadDuration, Targets, format_duration, met, missed, parse_duration, resolve
from llmgw.state.keypolicy import ApiKeyInvalid, ApiKeyRecord, describe_key, key_changes, updated
from llmgw.state.records import EndpointInfo
from llmgw.state.store import CatalogOutline
from llmgw.surface import CHAT


@pytest.mark.parametrize("text,seconds", [
    ("500ms", 0.5), ("0.5s", 0.5), ("2s", 2.0), (" 80 ms ", 0.08), ("5m", 300.0), ("1h", 3600.0), (".25s", 0.25),
    ("7d" if False else "168h", 7 * 86400.0),
])
def test_a_duration_is_read_with_its_unit(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text,fragment", [
    ("500", "give its unit"), ("0.5", "give its unit"), ("fast", "expected a duration"), ("80us", "expected a duration"),
    ("0ms", "more than 0"), ("200h", "at most 7 days"), ("-1s", "expected a duration"), (0.5, "with its unit"),
    ("", "expected a duration"),
])
def test_a_bad_duration_says_why(text, fragment):
    with pytest.raises(BadDuration) as e:
        parse_duration(text)
    assert fragment in str(e.value)


def test_a_duration_is_written_back_as_it_is_read():
    for s in (0.08, 0.3, 2.0, 60.0, 86400.0):
        assert parse_duration(format_duration(s)) == pytest.approx(s)


H, K, M = Targets(ttft=0.3), Targets(ttft=1.0, tpot=0.08), Targets(ttft=5.0, tpot=0.2, deadline=60.0, strict=True)


@pytest.mark.parametrize("header,key,model,expected", [
    (NO_TARGETS, None, None, NO_TARGETS),
    (H, None, None, H),
    (NO_TARGETS, K, None, K),
    (NO_TARGETS, None, M, M),
    (H, K, None, Targets(0.3, 0.08)),  # each target on its own: the header's TTFT, the key's TPOT
    (H, K, M, Targets(0.3, 0.08, 60.0, True)),  # strict when any says so
    (Targets(strict=True), None, None, Targets(strict=True)),  # strict alone asks for nothing
    (NO_TARGETS, K, M, Targets(1.0, 0.08, 60.0, True)),
])
def test_targets_come_from_the_headers_then_the_key_then_the_model(header, key, model, expected):
    assert resolve(header, key, model) == expected


def test_targets_without_a_target_are_false_even_when_strict():
    assert not NO_TARGETS and not Targets(strict=True) and Targets(deadline=1.0)


@pytest.mark.parametrize("t,ttft,tpot,total,ok", [
    (Targets(ttft=0.3), 0.2, None, 5.0, True),
    (Targets(ttft=0.3), 0.31, None, 5.0, False),
    (Targets(ttft=0.3), None, None, 5.0, False),  # no first byte seen: not met
    (Targets(tpot=0.05), 0.1, 0.04, 2.0, True),
    (Targets(tpot=0.05), 0.1, 0.06, 2.0, False),
    (Targets(tpot=0.05), 0.1, None, 2.0, True),  # not measured (no usage): not counted against it
    (Targets(deadline=60.0), 1.0, None, 59.0, True),
    (Targets(deadline=60.0), 1.0, None, 61.0, False),
    (Targets(ttft=5.0, deadline=60.0), 0.1, 0.01, None, False),  # it did not end whole
])
def test_whether_an_answer_met_its_targets(t, ttft, tpot, total, ok):
    assert met(t, ttft, tpot, total) is ok
    assert (missed(t, ttft, tpot, total) == "") is ok


def environ(**headers) -> dict:
    env = {"REQUEST_METHOD": "POST", "wsgi.input": io.BytesIO(b"")}
    env.update({"HTTP_" + k.upper().replace("-", "_"): v for k, v in headers.items()})
    return env


def test_the_headers_ask_for_targets():
    assert asked(environ()) is NO_TARGETS
    got = asked(environ(X_LLMGW_TTFT="300ms", X_LLMGW_TPOT="0.08s", X_LLMGW_Deadline="60s", X_LLMGW_SLO="strict"))
    assert got == Targets(0.3, 0.08, 60.0, True)
    assert asked(environ(X_LLMGW_SLO="lax", X_LLMGW_TTFT="2s")) == Targets(ttft=2.0)


@pytest.mark.parametrize("header,value,fragment", [
    ("X-LLMGW-TTFT", "300", "give its unit"), ("X-LLMGW-TPOT", "soon", "expected a duration"),
    ("X-LLMGW-Deadline", "0s", "more than 0"), ("X-LLMGW-SLO", "hard", "expected one of strict, lax"),
])
def test_a_bad_header_is_a_400_that_names_it(header, value, fragment):
    with pytest.raises(ApiError) as e:
        asked(environ(**{header.replace("-", "_"): value}))
    assert e.value.status == 400 and e.value.param == header
    assert e.value.message.startswith(header + ": ") and fragment in e.value.message


CATALOG = """
models:
  - name: m
    aliases: [chat]
    slo: {ttft: 500ms, tpot: 80ms, deadline: 1m, strict: true}
    profiles: [{name: s, engine: sim}]
  - name: plain
    profiles: [{name: s, engine: sim}]
"""


def tables():
    cat = parse_catalog_text(CATALOG)
    m = cat.model("m")
    eps = [EndpointInfo(id="a", url="http://a", models=("m", "chat"), engine="sim", model="m", **endpoint_fields(m.slo)),
           EndpointInfo(id="b", url="http://b", models=("plain",), engine="sim", model="plain")]
    return tables_from(1, "f", eps, CatalogOutline(), {})


def call(model: str, **body) -> Call:
    data = json.dumps({"model": model, "messages": [], **body}).encode()
    return Call(ROUTES[CHAT], model, data, json.loads(data))


def test_the_catalog_slo_block_is_published_and_planned_for_its_model_and_aliases():
    t = tables()
    assert t.slos == {"m": Targets(0.5, 0.08, 60.0, True)}
    assert plan(call("chat"), t, "standard", None, None).targets == Targets(0.5, 0.08, 60.0, True)
    assert plan(call("plain"), t, "standard", None, None).targets is NO_TARGETS
    # the header first, then the key, then the model
    p = plan(call("m"), t, "standard", None, None, True, Targets(ttft=0.2), Targets(tpot=0.05))
    assert p.targets == Targets(0.2, 0.05, 60.0, True)
    assert plan(call("plain"), t, "standard", None, None, True, NO_TARGETS, Targets(deadline=9.0)).targets == \
        Targets(deadline=9.0)


def test_a_key_carries_default_targets_set_by_its_flags():
    rec = ApiKeyRecord("k-1", "team", "h")
    ch = key_changes({"slo_ttft": "500ms", "slo_tpot": "80ms", "slo_deadline": None}, 0.0)
    assert ch == {"slo_ttft": 0.5, "slo_tpot": 0.08}
    new = updated(rec, ch)
    assert new.slo() == Targets(0.5, 0.08) and "targets ttft 500ms, tpot 80ms" in describe_key(new)
    assert ApiKeyRecord.from_json("k-1", new.to_json()) == new  # stored and read back
    cleared = updated(new, key_changes({"slo_ttft": "none", "slo_tpot": "none"}, 0.0))
    assert cleared.slo() is None
    with pytest.raises(ApiKeyInvalid) as e:
        key_changes({"slo_tpot": "80"}, 0.0)
    assert str(e.value).startswith("--slo-tpot: ") and "give its unit" in str(e.value)
    with pytest.raises(ValueError):
        ApiKeyRecord.from_json("k-1", json.dumps({"hash": "h", "slo_ttft": -1}))


def test_a_batch_line_is_sent_with_what_is_left_of_its_window_as_its_deadline():
    from gateway.request.targets import asked as read
    from workers.batch.client import deadline_header

    assert deadline_header(1000.0 + 86400, 1000.0) == "86400000ms"
    assert read(environ(X_LLMGW_Deadline=deadline_header(1000.0 + 86400, 1000.0))) == Targets(deadline=86400.0)
    assert deadline_header(1000.0 + 7 * 86400, 1000.0) is not None  # the longest window is read back
    assert read(environ(X_LLMGW_Deadline=deadline_header(7 * 86400.0, 0.0))).deadline == 7 * 86400.0
    assert deadline_header(1000.0, 1000.0) is None and deadline_header(999.0, 1000.0) is None
