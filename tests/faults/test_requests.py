"""Hostile requests against a running gateway (issue 15, bad input): hypothesis fuzzes bodies, headers and
paths sent over raw sockets to the real gateway under gunicorn, with sim engines behind it.

Whatever arrives, the gateway answers, within a deadline, with an HTTP status below 500:
- a body that is not UTF-8, not JSON or not a JSON object: 400;
- a body over LLMGW_GATEWAY_MAX_BODY_BYTES (sent with a length, chunked, or only declared): 413;
- huge or odd header values: 400/431 from gunicorn's parser, or served; never a 500, never a hang.

Raw sockets (tests.faults.rawhttp), because an HTTP library refuses to send most of this: a gateway
that never answers, or never ends its answer, fails a deadline instead of hanging the test. The
examples are derandomized (the same ones every run, so a failure reproduces; hypothesis prints the
falsifying example) and bounded to keep the whole module near a minute on two cores.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faults.fleet import AGENT
from tests.faults.rawhttp import RawGateway
from harness.cluster import sim_catalog

pytestmark = [pytest.mark.faults, pytest.mark.slow]

LIMIT = 64 * 1024  # LLMGW_GATEWAY_MAX_BODY_BYTES for this gateway: oversized bodies stay cheap to send
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/tokenize"]
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def served(status: int, raw: object, transfer_coding: bool = False) -> None:
    """Answered without a server error. The one 5xx allowed is gunicorn's 501 for a Transfer-Encoding
    it does not implement, which is what HTTP asks of a server (RFC 9112, section 6.1)."""
    assert status < 500 or (status == 501 and transfer_coding), f"{status} for {raw!r}"


@pytest.fixture
def gateway(cluster) -> RawGateway:
    [url] = cluster.start_system(sim_catalog(capacity=64), node_env=AGENT,
                                 gateway_env={"LLMGW_GATEWAY_MAX_BODY_BYTES": str(LIMIT)}, routed=1)
    gw = RawGateway(url)
    status, _h, body = gw.post("/v1/chat/completions", json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode())
    assert status == 200, body  # the fuzzing below is against a gateway that serves
    return gw


# --- strategies ------------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "messages", "prompt", "input", "stream", "max_tokens", "user", "n", "temperature",
          "previous_response_id", "stream_options", "tools"]
# A request object with the fields engines read, each of any JSON type (the right ones now and then).
REQUEST_OBJECTS = st.fixed_dictionaries({}, optional={
    **{f: JSON_VALUES for f in FIELDS},
    "model": st.sampled_from(["chat", "nope", "", "../x", "http://127.0.0.1:1/x"]) | JSON_VALUES,
    "max_tokens": st.integers(-5, 64) | JSON_VALUES,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                "content": JSON_VALUES}), max_size=3) | JSON_VALUES,
})

# A well-formed chat request whose other fields are anything: reaches the engine and comes back.
NEAR_VALID = st.fixed_dictionaries({
    "model": st.just("chat"), "messages": st.just([{"role": "user", "content": "hi"}]),
}, optional={"max_tokens": st.integers(1, 8), **{f: JSON_VALUES for f in FIELDS[3:]}})


def not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def is_json(b: bytes) -> bool:
    try:
        json.loads(b)
        return True
    except (ValueError, RecursionError):
        return False


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    return b'{"model": "chat", "x": ' + opener * depth + closer * depth + b"}"


# --- the properties --------------------------------------------------------------------------------
def test_fuzzed_requests_never_get_a_500_or_hang(gateway):
    gw = gateway

    @FUZZ
    @given(path=st.sampled_from(PATHS), body=st.binary(max_size=2000))
    def any_bytes(path, body):
        status, _h, answer = gw.post(path, body)
        served(status, body)
        if not_utf8(body) or not is_json(body):
            assert status == 400, (body, status, answer)

    @FUZZ
    @given(path=st.sampled_from(PATHS), obj=NEAR_VALID | REQUEST_OBJECTS | JSON_VALUES)
    def any_json(path, obj):
        body = json.dumps(obj).encode()
        status, _h, answer = gw.post(path, body)
        served(status, obj)
        if not isinstance(obj, dict):
            assert status == 400, (obj, status, answer)

    @FUZZ
    @given(body=st.text(max_size=200).map(lambda t: json.dumps({"model": "chat", "prompt": t}).encode()),
           bad=st.binary(min_size=1, max_size=4).filter(not_utf8), at=st.integers(0, 10_000))
    def broken_utf8(body, bad, at):
        at = at % len(body)
        raw = body[:at] + bad + body[at:]
        status, _h, answer = gw.post("/v1/completions", raw)
        assert status == 400, (raw, status, answer)

    @FUZZ
    @given(extra=st.integers(1, 4 * LIMIT), how=st.sampled_from(["declared", "sent", "chunked"]))
    def oversized(extra, how):
        size = LIMIT + extra
        raw = b'{"model": "chat", "prompt": "' + b"x" * size + b'"}'
        if how == "declared":  # a Content-Length over the limit, and no body behind it: answered at once
            status, _h, answer = gw.post("/v1/chat/completions", b"", length=size)
        elif how == "sent":
            status, _h, answer = gw.post("/v1/chat/completions", raw)
        else:  # no length said beforehand: the gateway reads one byte past the limit, no more
            chunked = b"".join(b"%x\r\n%s\r\n" % (len(raw[i:i + 8192]), raw[i:i + 8192])
                               for i in range(0, len(raw), 8192)) + b"0\r\n\r\n"
            status, _h, answer = gw.exchange(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                             b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                                             + chunked)
        assert status == 413, (size, how, status, answer)

    @FUZZ
    @given(obj=NEAR_VALID, length=st.integers(0, LIMIT))
    def wrong_length(obj, length):
        # A Content-Length that is not the body's: the body ends early (the client half-closes) or goes
        # on past it (the rest is a second, garbled request on a connection that is to close).
        raw = json.dumps(obj).encode()
        status, _h, answer = gw.post("/v1/chat/completions", raw, length=length)
        served(status, (length, raw))
        if length < len(raw) or length > len(raw):
            assert status == 400, (length, raw, status, answer)

    @FUZZ
    @given(depth=st.integers(1, 200_000), kind=st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    def deep(depth, kind):
        raw = nested(depth, *kind)
        status, _h, answer = gw.post("/v1/chat/completions", raw)
        served(status, raw[:100])
        if len(raw) > LIMIT:
            assert status == 413, (depth, status, answer)

    for prop in (any_bytes, any_json, broken_utf8, oversized, wrong_length, deep):
        prop()
    print(f"fuzzed bodies: {sum(gw.statuses.values())} requests, statuses {dict(sorted(gw.statuses.items()))}")


# Header values as they arrive on the wire: any byte but CR and LF (which would end the header line).
HEADER_VALUE = st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")) | st.builds(
    lambda c, n: c * n, st.sampled_from([b"a", b"\xff", b" ", b"\t", b"%", b"\x00"]), st.integers(0, 20_000))
HEADER_NAME = st.sampled_from([b"Authorization", b"X-Request-Id", b"X-LLMGW-Priority", b"X-Session-Id",
                               b"Content-Type", b"Content-Length", b"Transfer-Encoding", b"Host", b"Expect",
                               b"X-Forwarded-For", b"X-Forwarded-Host", b"Api-Key", b"Accept-Encoding"]) | \
    st.binary(min_size=1, max_size=40).filter(lambda b: b":" not in b and b"\r" not in b and b"\n" not in b)
GOOD_BODY = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def test_fuzzed_headers_never_get_a_500_or_hang(gateway):
    gw = gateway

    @FUZZ
    @given(headers=st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), min_size=1, max_size=4))
    def any_headers(headers):
        status, _h, answer = gw.post("/v1/chat/completions", GOOD_BODY, headers=headers)
        served(status, headers, any(k.lower() == b"transfer-encoding" for k, _v in headers))

    @FUZZ
    @given(path=st.binary(min_size=1, max_size=3000).map(lambda b: b.replace(b" ", b"%20").replace(b"\r", b"")
                                                          .replace(b"\n", b"")),
           method=st.sampled_from([b"GET", b"POST", b"DELETE", b"PUT", b"OPTIONS", b"BREW"]))
    def any_path(path, method):
        raw = method + b" /" + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
        status, _h, answer = gw.exchange(raw)
        served(status, raw[:200])

    for prop in (any_headers, any_path):
        prop()
    print(f"fuzzed headers and paths: {sum(gw.statuses.values())} requests, "
          f"statuses {dict(sorted(gw.statuses.items()))}")
